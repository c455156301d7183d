// CoordinatorCore: a shard group's membership and state machine (DESIGN 8): a rank becoming
// live in its group, the group forming, failing when a member dies, re-forming in a new epoch,
// and what a clean leave costs it.
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

void CoordinatorCore::AnnounceReformed(Job& job, ShardGroup& group, int rank) {
  v1::CoordinatorMessage notice;
  notice.mutable_notice()->set_kind(v1::Notice::KIND_GROUP_REFORMED);
  notice.mutable_notice()->set_group(group.index);
  notice.mutable_notice()->set_epoch(group.epoch);
  notice.mutable_notice()->set_message(absl::StrCat("group ", group.index, " re-formed at epoch ", group.epoch,
                                                    " (rank ", rank, " registered again)"));
  for (Member& m : group.members) {
    if (m.rank != rank) SendTo(m, notice);
  }
}

// The group state machine (DESIGN 8): FORMING -> HEALTHY -> FAILED -> FORMING (epoch + 1),
// FINISHED when every member left.
void CoordinatorCore::UpdateGroupState(Job& job, ShardGroup& group) {
  const auto [live, left, dead] = group.Count();
  const int size = group.size();
  const v1::GroupState before = group.state;
  // Recovering after a restart: FinishRecovery or ExpireRecovery ends it, or a death.
  if (before == v1::GROUP_STATE_RECOVERING && dead == 0) return;
  const bool reforming = before == v1::GROUP_STATE_FAILED || before == v1::GROUP_STATE_FINISHED;
  if (dead > 0) {
    group.state = v1::GROUP_STATE_FAILED;
  } else if (left == size) {
    group.state = v1::GROUP_STATE_FINISHED;
  } else if (reforming && live < size) {
    // After a failure (or after everyone left) the group re-forms only once every member
    // is live again: members that merely left would make it decide for ranks not there.
    group.state = v1::GROUP_STATE_FORMING;
    group.failure_reason.clear();
  } else if (live + left < size) {
    // Some member never registered (it may have died before it did).
    group.state = v1::GROUP_STATE_FORMING;
  } else if (before == v1::GROUP_STATE_FORMING && !group.formed) {
    // Formed for the first time: the promotion budget is known now. (Under root or replicate
    // its first members may have been given decisions already: they need no group.)
    group.state = v1::GROUP_STATE_HEALTHY;
    group.formed = true;
    const int64_t min_budget = group.SetPromotionBudget();
    Event("info", EventKind::kGroupFormed, job.id, -1, group.index,
          absl::StrCat("ranks ", RankList(group.ranks), " policy=",
                       PolicyName(group.engine->config().policy),
                       " fallback=", FallbackName(group.engine->config().fallback),
                       " min_memory_budget_bytes=", min_budget));
  } else if (before != v1::GROUP_STATE_HEALTHY) {
    // Whole again after a failure: a new epoch. Microbatch keys start afresh (a job
    // resumed from a checkpoint plans earlier steps again). The seq goes on, for every policy.
    group.epoch++;
    group.failure_reason.clear();
    group.RestartKeys();
    if (group.engine->config().min_memory_budget_bytes == 0 && group.engine->next_seq() == 0) {
      group.SetPromotionBudget();  // Whole for the first time through a failure.
    }
    group.state = v1::GROUP_STATE_HEALTHY;
    group.formed = true;
    Event("info", EventKind::kGroupReformed, job.id, -1, group.index,
          absl::StrCat("epoch ", group.epoch, " ranks ", RankList(group.ranks)));
  }
}

void CoordinatorCore::OnLeft(Job& job, ShardGroup& group, const Member& m) {
  // Pending microbatches it never reported can never be decided.
  const int idx = group.IndexOf(m.rank);
  std::vector<MicrobatchKey> doomed;
  for (const auto& [k, p] : group.pending) {
    if (!p.reported[idx]) doomed.push_back(k);
  }
  for (const auto& k : doomed) {
    FailMicrobatch(job, group, k, absl::FailedPreconditionError(absl::StrCat(
        "microbatch ", k.ToString(), " of group ", group.index, " can never be decided: rank ",
        m.rank, " left the job without planning it")));
  }
  UpdateGroupState(job, group);
  DrainGroup(job, group);
  Flush(group);
}

void CoordinatorCore::FailGroup(Job& job, ShardGroup& group, const Member& m, const std::string& full) {
  // A death fails the group: cancel everything pending and tell every live member.
  const bool was_failed = group.state == v1::GROUP_STATE_FAILED;
  // Whole again, it re-forms in a new epoch with a notice, even if it never formed before:
  // its live members hold this failure until they hear of the re-form.
  group.formed = true;
  if (group.state == v1::GROUP_STATE_RECOVERING) {
    // The recovery is over: what the members resumed with is held no longer (nor charged).
    for (Member& member : group.members) {
      member.resume.reset();
      member.resume_charge = BufferCharge();
    }
    group.recovery_deadline = absl::InfiniteFuture();
  }
  v1::CoordinatorMessage msg;
  auto* gf = msg.mutable_group_failure();
  gf->set_group(group.index);
  gf->set_epoch(group.epoch);
  for (const Member& member : group.members) {
    if (member.state == v1::RANK_STATE_DEAD) gf->add_dead_ranks(member.rank);
  }
  for (const auto& [k, p] : group.pending) ToProto(k, gf->add_cancelled());
  group.pending.clear();
  group.failure_reason =
      was_failed && !group.failure_reason.empty() ? absl::StrCat(group.failure_reason, "; ", full) : full;
  gf->set_reason(absl::StrCat("group ", group.index, " of job '", job.id, "' failed at epoch ",
                              group.epoch, ": ", group.failure_reason));
  UpdateGroupState(job, group);
  for (Member& member : group.members) SendTo(member, msg);
  Event("error", EventKind::kGroupFailed, job.id, m.rank, group.index,
        absl::StrCat(gf->reason(), "; cancelled ", gf->cancelled_size(), " pending microbatches"));
  NotifyRankLost(job, group, m.rank, gf->reason());
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
