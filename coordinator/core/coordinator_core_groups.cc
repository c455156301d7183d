// CoordinatorCore: a rank becoming live in its group, its RegisterResponse, and a death in a
// group told to the rest of the job (the group's state machine is ShardGroup's,
// shard_group_states.cc, DESIGN 8).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/daemon_metrics.h"
#include "coordinator/core/secrets.h"
#include "coordinator/engine/text.h"
#include "shardcoord/decide.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"

namespace shardcoord::coordinator {

void CoordinatorCore::SetLive(Job& job, const Member& m, uint64_t session_id, std::shared_ptr<RankSink> sink,
                              const Registration& req) {
  GroupSlot& slot = *job.groups[m.group];
  HeldGroup held(job, slot);
  SessionBinding& b = slot.group.binding(m.rank);
  if (b.session != 0) jobs_.ForgetSession(b.session);
  slot.group.MemberLive(m.rank, req, clock_->Now());
  b.session = session_id;
  b.sink = std::move(sink);
  b.cut_reason.clear();
  b.session_key = NewSessionKey();
  b.registration = ++last_registration_;
  job.ended = absl::InfinitePast();
  jobs_.BindSession(session_id, job, req.rank);
}

void CoordinatorCore::FailGroup(Job& job, ShardGroup& group, int idx, const std::string& full) {
  GroupEffects fx;
  const std::string reason = group.Fail(idx, full, fx);
  Apply(job, group, fx);
  NotifyRankLost(job, group, group.ranks()[idx], reason);
}

void CoordinatorCore::NotifyRankLost(Job& job, const ShardGroup& group, int rank, const std::string& reason) {
  // The rest of the job (DESIGN 3): collectives that span groups include the dead rank too.
  if (job.groups.size() < 2) return;
  v1::CoordinatorMessage msg;
  auto* n = msg.mutable_notice();
  n->set_kind(v1::Notice::KIND_RANK_LOST);
  n->set_group(group.index());
  n->set_epoch(group.epoch());
  n->set_rank(rank);
  n->set_message(reason);
  ForEachMember(job, [&](const Member& other, SessionBinding& to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (other.group != group.index() && other.live()) SendTo(other, to, msg);
  });
}

}  // namespace shardcoord::coordinator
