// CoordinatorCore: plan intake and decisions (DESIGN 3), for static and dynamic policies alike.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/daemon_metrics.h"
#include "coordinator/core/invariant.h"
#include "coordinator/core/text.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {

v1::CoordinatorMessage CoordinatorCore::PlanRejectedMessage(const v1::MicrobatchPlan& plan, const absl::Status& why,
                                                            int64_t epoch) {
  v1::CoordinatorMessage msg;
  auto* rej = msg.mutable_plan_rejected();
  rej->set_step(plan.step());
  rej->set_microbatch(plan.microbatch());
  rej->set_code(static_cast<int>(why.code()));
  rej->set_message(std::string(why.message()));
  rej->set_epoch(epoch);
  return msg;
}

void CoordinatorCore::TakePlans(Job& job, ShardGroup& group, Member& m, const v1::PlanBatch& batch) {
  m.last_seen = clock_->Now();
  if (batch.plans_size() > MaxPlansPerBatch(m.lookahead)) {
    // A worker sends at most its window per message (a window and as many again while plans
    // of entries that failed locally wait to be sent, in an older worker): a client sending
    // more would get a rejection for each plan past the window, and those alone could fill
    // its outbox.
    if (m.cut_reason.empty()) {
      m.cut_reason = absl::StrCat("broke the protocol: sent ", batch.plans_size(),
                                  " plans in one batch; with a lookahead window of ", m.lookahead,
                                  " a worker sends at most ", MaxPlansPerBatch(m.lookahead));
    }
    return;
  }
  if (group.state == v1::GROUP_STATE_RECOVERING) {
    // Decided once every member has resumed (a static decision made now could contradict
    // one a member not back yet holds). Bounded like the pending microbatches.
    for (const auto& plan : batch.plans()) {
      if (static_cast<int>(group.deferred_plans.size()) >= options_.limits.max_pending_microbatches) {
        SendTo(m, PlanRejectedMessage(plan,
                                      absl::ResourceExhaustedError(absl::StrCat(
                                          "group ", group.index, " is recovering after a coordinator restart and "
                                          "already holds max_pending_microbatches plans; plan again once it recovered")),
                                      batch.epoch()));
        continue;
      }
      group.deferred_plans.emplace_back(m.rank, plan);
    }
    return;
  }
  for (const auto& plan : batch.plans()) {
    absl::Status s = batch.epoch() == group.epoch
                         ? AcceptPlan(job, group, m, plan)
                         : absl::AbortedError(absl::StrCat(
                               "plan ", MicrobatchKey{plan.step(), plan.microbatch()}.ToString(), " from rank ", m.rank,
                               " was made in epoch ", batch.epoch(), " but group ", group.index, " is at epoch ",
                               group.epoch, ": it was queued before the group failed; plan again"));
    if (!s.ok()) {
      m.plans_rejected++;
      const v1::CoordinatorMessage msg = PlanRejectedMessage(plan, s, batch.epoch());
      static logging::RateLimit limit(10);  // A client sending 10^5 bad plans gets 10 lines a second.
      int64_t suppressed = 0;
      if (limit.Allow(&suppressed)) {
        Defer([line = absl::StrCat("plan_rejected job=", job.id, " rank=", m.rank, " step=", plan.step(),
                                   " mb=", plan.microbatch(), " code=", absl::StatusCodeToString(s.code()), " ",
                                   s.message(),
                                   suppressed > 0 ? absl::StrCat(" (", suppressed, " more plan rejections not logged)")
                                                  : "")] {
          static const auto log = logging::Get("coordinator");
          log->warn("{}", line);
        });
      }
      SendTo(m, msg);
    }
  }
  Flush(group);
}

absl::Status CoordinatorCore::AcceptPlan(Job& job, ShardGroup& group, Member& m, const v1::MicrobatchPlan& plan) {
  const MicrobatchKey key{plan.step(), plan.microbatch()};
  const std::string who = absl::StrCat("rank ", m.rank, " (job '", job.id, "', group ", group.index, ")");
  absl::StatusOr<ShardGroup::PlanCalls> calls = group.ParsePlan(plan, key, who);
  if (!calls.ok()) return calls.status();
  if (absl::Status s = CheckPlanFits(group, m, key, who); !s.ok()) return s;

  // Accepted.
  const int idx = group.IndexOf(m.rank);
  job.plans_received++;
  const bool inserted = group.Report(key, idx, *calls, clock_->Now());
  const bool is_static = group.engine->is_static();
  if (is_static) {
    // root / replicate: the rank gets its decision at once, without waiting for the group.
    if (inserted) DecideStatic(job, group, key);
    QueueDecision(m, *group.pending.at(key).decided);
  }
  if (!FailSkipped(job, group, m, key, idx, inserted)) return absl::OkStatus();
  if (!is_static) {
    DrainGroup(job, group);
    return absl::OkStatus();
  }
  // A static key stays pending until every rank reported it, which is how a rank that skips
  // a microbatch is caught (the microbatch fails for the whole group, as under auto).
  auto it = group.pending.find(key);
  if (it->second.num_reported == group.size()) group.Resolve(it);
  return absl::OkStatus();
}

absl::Status CoordinatorCore::CheckPlanFits(const ShardGroup& group, const Member& m, const MicrobatchKey& key,
                                            const std::string& who) const {
  if (m.last_planned && key <= *m.last_planned) {
    return absl::FailedPreconditionError(absl::StrCat(
        "out-of-order plan ", key.ToString(), " from ", who, ": its previous plan was ",
        m.last_planned->ToString(), "; plans must be reported in increasing (step, microbatch) order"));
  }
  if (group.state == v1::GROUP_STATE_FAILED) {
    return absl::AbortedError(absl::StrCat("plan ", key.ToString(), " from ", who,
                                           " dropped: the group failed at epoch ", group.epoch,
                                           " (", group.failure_reason,
                                           "); wait for the group to re-form"));
  }
  auto pending = group.pending.find(key);
  const bool known = pending != group.pending.end();
  if (!known && group.last_resolved && key <= *group.last_resolved) {
    return absl::FailedPreconditionError(absl::StrCat(
        "plan ", key.ToString(), " from ", who, " is stale: group ", group.index,
        " already resolved every microbatch up to ", group.last_resolved->ToString()));
  }
  const int idx = group.IndexOf(m.rank);
  // A static decision is given at once: no window to wait in. A key the rank reported before
  // (it left and came back) is in its window already.
  if (!group.engine->is_static() && !(known && pending->second.reported[idx])) {
    const int undecided = group.PendingOf(idx);
    if (undecided >= m.lookahead) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "plan ", key.ToString(), " from ", who, " is beyond the lookahead window: ", undecided,
          " plans are undecided and the window is ", m.lookahead,
          "; wait for the oldest decision before planning further ahead"));
    }
  }
  if (known) return absl::OkStatus();
  return group.CheckPendingRoom(key, who, options_.limits.max_pending_microbatches);
}

bool CoordinatorCore::FailSkipped(Job& job, ShardGroup& group, Member& m, const MicrobatchKey& key, int idx,
                                  bool inserted) {
  // Microbatches this rank skipped: earlier pending ones it never reported.
  std::vector<MicrobatchKey> skipped;
  for (auto& [k, pk] : group.pending) {
    if (!(k < key)) break;
    if (!pk.reported[idx]) skipped.push_back(k);
  }
  for (const auto& k : skipped) {
    FailMicrobatch(job, group, k, absl::FailedPreconditionError(absl::StrCat(
        "microbatch ", k.ToString(), " of group ", group.index, " can never be decided: rank ",
        m.rank, " reported ", key.ToString(), " without reporting ", k.ToString(),
        "; every rank of a shard group must run the same microbatches")));
  }
  if (!inserted) return true;
  // Ranks that already moved past this key (or left) will never report it.
  const PendingMicrobatch& p = group.pending.at(key);
  std::vector<int> never;
  for (size_t i = 0; i < group.ranks.size(); ++i) {
    if (!p.reported[i] && group.members[i].WillNeverReport(key)) never.push_back(group.ranks[i]);
  }
  if (never.empty()) return true;
  FailMicrobatch(job, group, key, absl::FailedPreconditionError(absl::StrCat(
      "microbatch ", key.ToString(), " of group ", group.index, " can never be decided: ranks ", RankList(never),
      " already planned later microbatches or left; every rank of a shard group must run the same microbatches")));
  return false;
}

void CoordinatorCore::DecideStatic(Job& job, ShardGroup& group, const MicrobatchKey& key) {
  v1::MicrobatchDecision pd;
  ToProto(group.engine->DecideStatic(key, group.epoch), &pd);
  pd.set_seal(resume_auth_.Seal(job.id, pd));
  pd.set_decided_unix_ms(absl::ToUnixMillis(clock_->Now()));
  RecordDecision(job, group, pd);
  group.pending.at(key).decided = std::move(pd);
}

void CoordinatorCore::DrainGroup(Job& job, ShardGroup& group) {
  if (group.state != v1::GROUP_STATE_HEALTHY) return;  // Forming: not everyone can plan yet.
  if (group.engine->is_static()) return;              // Decided as reported (AcceptPlan).
  while (!group.pending.empty()) {
    auto it = group.pending.begin();
    if (it->second.num_reported < group.size()) break;
    // The engine decides in key order (its promotion window and seq depend on it).
    if (group.last_drained && !(*group.last_drained < it->first)) {
      const std::string what = absl::StrCat("group ", group.index, " of job '", job.id, "' would decide ",
                                            it->first.ToString(), " after deciding ",
                                            group.last_drained->ToString(), " in epoch ", group.epoch);
      SHARDCOORD_INVARIANT(false, what);
      FailMicrobatch(job, group, it->first, absl::InternalError(absl::StrCat("internal error: ", what)));
      continue;
    }
    std::vector<EngineTransition> transitions;
    MicrobatchDecision d = group.engine->Decide(it->first, group.epoch, it->second.calls, &transitions);
    const absl::Time now = clock_->Now();
    metrics_->ObserveDecisionLatency(now - it->second.first_report);
    v1::MicrobatchDecision pd;
    ToProto(d, &pd);
    pd.set_seal(resume_auth_.Seal(job.id, pd));
    pd.set_decided_unix_ms(absl::ToUnixMillis(now));
    for (Member& mem : group.members) QueueDecision(mem, pd);
    group.last_drained = it->first;
    RecordDecision(job, group, pd);
    group.Resolve(it);
    for (const auto& t : transitions) {
      const EventKind kind = t.what == "promoted"      ? EventKind::kModulePromoted
                             : t.what == "demoted"     ? EventKind::kModuleDemoted
                             : t.what == "cost_choice" ? EventKind::kModuleCostChoice
                                                       : EventKind::kModuleStickyReplicate;
      Event("info", kind, job.id, -1, group.index,
            absl::StrCat("module '", t.module, "': ", t.detail));
    }
  }
}

void CoordinatorCore::RecordDecision(Job& job, ShardGroup& group, const v1::MicrobatchDecision& d) {
  job.microbatches_decided++;
  group.RecordDecision(d, options_.decision_history);
}

void CoordinatorCore::FailMicrobatch(Job& job, ShardGroup& group, const MicrobatchKey& key,
                                     absl::Status why) {
  auto it = group.pending.find(key);
  if (it == group.pending.end()) return;
  v1::CoordinatorMessage msg;
  auto* f = msg.mutable_microbatch_failed();
  f->set_group(group.index);
  f->set_step(key.step);
  f->set_microbatch(key.microbatch);
  f->set_code(static_cast<int>(why.code()));
  f->set_message(std::string(why.message()));
  for (Member& mem : group.members) SendTo(mem, msg);
  group.Resolve(it);
  Event("error", EventKind::kMicrobatchFailed, job.id, -1, group.index, std::string(why.message()));
}

}  // namespace shardcoord::coordinator
