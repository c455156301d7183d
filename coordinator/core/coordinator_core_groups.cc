// CoordinatorCore: a rank becoming live in its group, its RegisterResponse, and a death in a
// group told to the rest of the job (the group's state machine is ShardGroup's,
// shard_group_states.cc, DESIGN 8).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/daemon_metrics.h"
#include "coordinator/core/secrets.h"
#include "coordinator/core/text.h"
#include "shardcoord/decide.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"

namespace shardcoord::coordinator {

void CoordinatorCore::SetLive(Job& job, Member& m, uint64_t session_id, std::shared_ptr<RankSink> sink,
                              const v1::RegisterRequest& req) {
  if (m.session != 0) sessions_.erase(m.session);
  m.state = v1::RANK_STATE_LIVE;
  m.session = session_id;
  m.sink = std::move(sink);
  m.host = req.host();
  m.pid = req.pid();
  m.last_seen = clock_->Now();
  m.last_planned.reset();
  m.dead_reason.clear();
  m.resume.reset();  // A resume is held only from ResumeMember on (which sets it after this).
  m.resume_charge = BufferCharge();
  m.registrations++;
  m.lookahead = req.lookahead();
  m.memory_budget = req.memory_budget_bytes();
  m.cut_reason.clear();
  m.session_key = NewSessionKey();
  job.ended = absl::InfinitePast();
  sessions_[session_id] = SessionRef{&job, req.rank()};
}

v1::CoordinatorMessage CoordinatorCore::Registered(const ShardGroup& group, const v1::RegisterRequest& req) const {
  v1::CoordinatorMessage msg;
  v1::RegisterResponse* resp = msg.mutable_registered();
  resp->set_group(group.index);
  for (int r : group.ranks) resp->add_group_ranks(r);
  resp->set_heartbeat_interval_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  resp->set_heartbeat_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_timeout)));
  resp->set_policy(req.policy());
  resp->set_fallback(req.fallback());
  resp->set_lookahead(req.lookahead());
  resp->set_coordinator_version(shardcoord::kVersion);
  resp->set_accepts_bundles(true);  // Deprecated: what workers built before bundles only look at.
  if (FromProto(req.policy()) == Policy::kPerLayer) {
    resp->add_warnings("policy per_layer: microbatches where ranks of the group diverge fall back to " +
                       std::string(FallbackName(FromProto(req.fallback()))) +
                       "; only uniform or all-skip microbatches shard per layer");
  }
  if (group.last_decided) ToProto(*group.last_decided, resp->mutable_last_decided());
  resp->set_incarnation(incarnation_);
  resp->set_config_digest(config_digest_);
  return msg;
}

void CoordinatorCore::FailGroup(Job& job, ShardGroup& group, int idx, const std::string& full) {
  GroupEffects fx;
  const std::string reason = group.Fail(idx, full, fx);
  Apply(job, group, fx);
  NotifyRankLost(job, group, group.ranks[idx], reason);
}

void CoordinatorCore::NotifyRankLost(Job& job, const ShardGroup& group, int rank, const std::string& reason) {
  // The rest of the job (DESIGN 3): collectives that span groups include the dead rank too.
  if (job.groups.size() < 2) return;
  v1::CoordinatorMessage msg;
  auto* n = msg.mutable_notice();
  n->set_kind(v1::Notice::KIND_RANK_LOST);
  n->set_group(group.index);
  n->set_epoch(group.epoch);
  n->set_rank(rank);
  n->set_message(reason);
  ForEachMember(job, [&](Member& other) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (other.group != group.index && other.live()) SendTo(other, msg);
  });
}

}  // namespace shardcoord::coordinator
