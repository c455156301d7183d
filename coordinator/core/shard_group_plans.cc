// ShardGroup: plan intake and decisions (DESIGN 3), for static and dynamic policies alike,
// and the heartbeat's share of the group (liveness, memory, costs).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/invariant.h"
#include "coordinator/core/shard_group.h"
#include "coordinator/engine/text.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {

void ShardGroup::TakePlans(int idx, const PlanBatchReport& batch, absl::Time now, GroupEffects& fx) {
  Member& m = members_[idx];
  m.last_seen = now;
  if (static_cast<int64_t>(batch.plans.size()) > MaxPlansPerBatch(m.lookahead)) {
    // A worker sends at most its window per message (a window and as many again while plans
    // of entries that failed locally wait to be sent, in an older worker): a client sending
    // more would get a rejection for each plan past the window, and those alone could fill
    // its outbox.
    fx.cuts.emplace_back(idx, absl::StrCat("broke the protocol: sent ", batch.plans.size(),
                                           " plans in one batch; with a lookahead window of ", m.lookahead,
                                           " a worker sends at most ", MaxPlansPerBatch(m.lookahead)));
    return;
  }
  const int max_pending = rules_.options->limits.max_pending_microbatches;
  for (const ReceivedPlan& received : batch.plans) {
    if (!received.malformed.empty()) {  // Nothing in it can be taken: no key to decide or wait for.
      Reject(idx, std::nullopt,
             absl::InvalidArgumentError(absl::StrCat("plan from rank ", m.rank, " (job '", rules_.job_id,
                                                     "', group ", index_, "): ", received.malformed)),
             batch.epoch, fx);
      continue;
    }
    const MicrobatchPlan& plan = received.plan;
    absl::Status s;
    if (state_ == v1::GROUP_STATE_RECOVERING) {
      // Decided once every member has resumed (a static decision made now could contradict
      // one a member not back yet holds). Bounded like the pending microbatches.
      if (static_cast<int>(deferred_plans_.size()) < max_pending) {
        deferred_plans_.emplace_back(m.rank, plan);
        continue;
      }
      s = absl::ResourceExhaustedError(absl::StrCat(
          "group ", index_, " is recovering after a coordinator restart and already holds "
          "max_pending_microbatches plans; plan again once it recovered"));
    } else if (batch.epoch != epoch_) {
      s = absl::AbortedError(absl::StrCat("plan ", plan.key.ToString(), " from rank ", m.rank, " was made in epoch ",
                                          batch.epoch, " but group ", index_, " is at epoch ", epoch_,
                                          ": it was queued before the group failed; plan again"));
    } else {
      s = AcceptPlan(idx, plan, now, fx);
    }
    if (!s.ok()) Reject(idx, plan.key, s, batch.epoch, fx);
  }
}

void ShardGroup::Reject(int idx, const std::optional<MicrobatchKey>& key, const absl::Status& why, int64_t in_epoch,
                        GroupEffects& fx) {
  Member& m = members_[idx];
  m.plans_rejected++;
  v1::CoordinatorMessage msg;
  auto* rej = msg.mutable_plan_rejected();
  if (key) ToProto(*key, rej->mutable_key());  // A keyless plan's rejection names none either.
  rej->set_code(static_cast<int>(why.code()));
  rej->set_message(std::string(why.message()));
  rej->set_epoch(in_epoch);
  fx.Send(idx, std::move(msg));
  fx.warnings.push_back(absl::StrCat("plan_rejected job=", rules_.job_id, " rank=", m.rank, " key=",
                                     key ? key->ToString() : "none", " code=", absl::StatusCodeToString(why.code()), " ",
                                     why.message()));
}

absl::Status ShardGroup::AcceptPlan(int idx, const MicrobatchPlan& plan, absl::Time now, GroupEffects& fx) {
  const MicrobatchKey& key = plan.key;
  const std::string who = absl::StrCat("rank ", ranks_[idx], " (job '", rules_.job_id, "', group ", index_, ")");
  absl::StatusOr<PlanCalls> calls = ParsePlan(plan, who);
  if (!calls.ok()) return calls.status();
  if (absl::Status s = CheckPlanFits(idx, key, who); !s.ok()) return s;

  // Accepted.
  fx.plans_accepted++;
  const bool inserted = Report(key, idx, *calls, now);
  if (!FailSkipped(idx, key, inserted, fx)) return absl::OkStatus();  // Failed: nothing to decide.
  if (!engine_->is_static()) {
    Drain(now, fx);
    return absl::OkStatus();
  }
  // root / replicate: the rank gets its decision at once, without waiting for the group. The
  // key stays pending until every rank reported it, which is how a rank that skips a
  // microbatch is caught (the microbatch fails for the whole group, as under auto).
  if (inserted) DecideStatic(key, now, fx);
  auto it = pending_.find(key);
  fx.Decide(idx, *it->second.decided);
  if (it->second.num_reported == size()) Resolve(it);
  return absl::OkStatus();
}

absl::Status ShardGroup::CheckPlanFits(int idx, const MicrobatchKey& key, const std::string& who) const {
  const Member& m = members_[idx];
  if (m.last_planned && key <= *m.last_planned) {
    return absl::FailedPreconditionError(absl::StrCat(
        "out-of-order plan ", key.ToString(), " from ", who, ": its previous plan was ",
        m.last_planned->ToString(), "; plans must be reported in increasing (step, microbatch) order"));
  }
  if (state_ == v1::GROUP_STATE_FAILED) {
    return absl::AbortedError(absl::StrCat("plan ", key.ToString(), " from ", who, " dropped: the group failed at epoch ",
                                           epoch_, " (", failure_reason_, "); wait for the group to re-form"));
  }
  auto found = pending_.find(key);
  const bool known = found != pending_.end();
  if (!known && last_resolved_ && key <= *last_resolved_) {
    return absl::FailedPreconditionError(absl::StrCat("plan ", key.ToString(), " from ", who, " is stale: group ",
                                                      index_, " already resolved every microbatch up to ",
                                                      last_resolved_->ToString()));
  }
  // A static decision is given at once: no window to wait in. A key the rank reported before
  // (it left and came back) is in its window already.
  if (!engine_->is_static() && !(known && found->second.reported[idx])) {
    const int undecided = PendingOf(idx);
    if (undecided >= m.lookahead) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "plan ", key.ToString(), " from ", who, " is beyond the lookahead window: ", undecided,
          " plans are undecided and the window is ", m.lookahead,
          "; wait for the oldest decision before planning further ahead"));
    }
  }
  if (known) return absl::OkStatus();
  return CheckPendingRoom(key, who, rules_.options->limits.max_pending_microbatches);
}

bool ShardGroup::FailSkipped(int idx, const MicrobatchKey& key, bool inserted, GroupEffects& fx) {
  // Microbatches this rank skipped: earlier pending ones it never reported.
  std::vector<MicrobatchKey> skipped;
  for (auto& [k, pk] : pending_) {
    if (!(k < key)) break;
    if (!pk.reported[idx]) skipped.push_back(k);
  }
  for (const auto& k : skipped) {
    FailMicrobatch(k,
                   absl::FailedPreconditionError(absl::StrCat(
                       "microbatch ", k.ToString(), " of group ", index_, " can never be decided: rank ", ranks_[idx],
                       " reported ", key.ToString(), " without reporting ", k.ToString(),
                       "; every rank of a shard group must run the same microbatches")),
                   fx);
  }
  if (!inserted) return true;
  // Ranks that already moved past this key (or left) will never report it.
  const PendingMicrobatch& p = pending_.at(key);
  std::vector<int> never;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (!p.reported[i] && members_[i].WillNeverReport(key)) never.push_back(ranks_[i]);
  }
  if (never.empty()) return true;
  FailMicrobatch(key,
                 absl::FailedPreconditionError(absl::StrCat(
                     "microbatch ", key.ToString(), " of group ", index_, " can never be decided: ranks ",
                     RankList(never),
                     " already planned later microbatches or left; every rank of a shard group must run the same "
                     "microbatches")),
                 fx);
  return false;
}

v1::MicrobatchDecision ShardGroup::Sealed(const MicrobatchDecision& d, absl::Time now) const {
  v1::MicrobatchDecision pd;
  ToProto(d, &pd);
  pd.set_seal(rules_.auth->Seal(rules_.job_id, pd));
  pd.set_decided_unix_ms(absl::ToUnixMillis(now));
  return pd;
}

void ShardGroup::Given(const v1::MicrobatchDecision& d, GroupEffects& fx) {
  fx.decided++;
  RecordDecision(d, rules_.options->decision_history);
}

namespace {

EventKind TransitionKind(const std::string& what) {
  return what == "promoted"      ? EventKind::kModulePromoted
         : what == "demoted"     ? EventKind::kModuleDemoted
         : what == "cost_choice" ? EventKind::kModuleCostChoice
         : what == "trainable_root" ? EventKind::kModuleTrainableRoot
                                 : EventKind::kModuleStickyReplicate;
}

}  // namespace

void ShardGroup::DecideStatic(const MicrobatchKey& key, absl::Time now, GroupEffects& fx) {
  std::vector<EngineTransition> transitions;
  v1::MicrobatchDecision pd = Sealed(engine_->DecideStatic(key, epoch_, &transitions), now);
  Given(pd, fx);
  pending_.at(key).decided = std::move(pd);
  for (const auto& t : transitions) {
    fx.Record(Severity::kInfo, TransitionKind(t.what), -1, absl::StrCat("module '", t.module, "': ", t.detail));
  }
}

void ShardGroup::Drain(absl::Time now, GroupEffects& fx) {
  if (state_ != v1::GROUP_STATE_HEALTHY) return;  // Forming: not everyone can plan yet.
  if (engine_->is_static()) return;              // Decided as reported (AcceptPlan).
  while (!pending_.empty()) {
    auto it = pending_.begin();
    if (it->second.num_reported < size()) break;
    // The engine decides in key order (its promotion window and seq depend on it).
    if (last_drained_ && !(*last_drained_ < it->first)) {
      const std::string what = absl::StrCat("group ", index_, " of job '", rules_.job_id, "' would decide ",
                                            it->first.ToString(), " after deciding ", last_drained_->ToString(),
                                            " in epoch ", epoch_);
      SHARDCOORD_INVARIANT(false, what);
      FailMicrobatch(it->first, absl::InternalError(absl::StrCat("internal error: ", what)), fx);
      continue;
    }
    std::vector<EngineTransition> transitions;
    const MicrobatchDecision d = engine_->Decide(it->first, epoch_, it->second.calls, &transitions);
    fx.decision_latencies.push_back(now - it->second.first_report);
    v1::MicrobatchDecision pd = Sealed(d, now);
    last_drained_ = it->first;
    Given(pd, fx);
    fx.Decide(GroupEffects::kEveryMember, std::move(pd));
    Resolve(it);
    for (const auto& t : transitions) {
      fx.Record(Severity::kInfo, TransitionKind(t.what), -1, absl::StrCat("module '", t.module, "': ", t.detail));
    }
  }
}

v1::CoordinatorMessage ShardGroup::MicrobatchFailed(const MicrobatchKey& key, const absl::Status& why) const {
  v1::CoordinatorMessage msg;
  auto* f = msg.mutable_microbatch_failed();
  f->set_group(index_);
  ToProto(key, f->mutable_key());
  f->set_code(static_cast<int>(why.code()));
  f->set_message(std::string(why.message()));
  return msg;
}

void ShardGroup::FailMicrobatch(const MicrobatchKey& key, const absl::Status& why, GroupEffects& fx) {
  auto it = pending_.find(key);
  if (it == pending_.end()) return;
  fx.Send(GroupEffects::kEveryMember, MicrobatchFailed(key, why));
  Resolve(it);
  fx.Record(Severity::kError, EventKind::kMicrobatchFailed, -1, std::string(why.message()));
}

void ShardGroup::ExpirePlans(absl::Time now, GroupEffects& fx) {
  const absl::Duration timeout = rules_.options->plan_timeout;
  std::vector<std::pair<MicrobatchKey, absl::Status>> expired;
  for (const auto& [k, p] : pending_) {
    const absl::Duration waited = now - p.first_report;
    if (waited <= timeout) continue;
    std::vector<int> missing, have;
    for (size_t i = 0; i < ranks_.size(); ++i) (p.reported[i] ? have : missing).push_back(ranks_[i]);
    expired.emplace_back(
        k, absl::DeadlineExceededError(absl::StrCat(
               "group ", index_, " waited ", absl::ToInt64Milliseconds(waited), " ms for the plan of ", k.ToString(),
               " from ranks ", RankList(missing), " (ranks ", RankList(have), " reported it); plan timeout is ",
               absl::ToInt64Milliseconds(timeout),
               " ms: raise --plan-timeout-ms if ranks legitimately fall this far behind")));
  }
  for (auto& [k, s] : expired) FailMicrobatch(k, s, fx);
  if (!expired.empty()) Drain(now, fx);  // What waited behind a failed key may be complete.
}

void ShardGroup::TakeHeartbeat(int idx, const HeartbeatReport& heartbeat, absl::Time now, GroupEffects& fx) {
  Member& m = members_[idx];
  m.last_seen = now;
  m.decision_stalls.Take(heartbeat.decision_stalls);
  m.decision_stall_us.Take(heartbeat.decision_stall_us);
  if (std::string moved = TakeCosts(idx, heartbeat, now); !moved.empty()) {
    fx.Record(Severity::kInfo, EventKind::kGroupCostModel, m.rank,
              absl::StrCat("cost model from the members' measures: ", moved));
  }
  if (heartbeat.memory.empty()) return;
  // Bounded by the manifest whatever the client sends: one entry per module of the group's
  // manifest (the first for each), no negative counts; the rest is not kept. A rank's
  // reports then cost no more than its share of the manifest (DESIGN 11).
  m.memory.clear();
  std::vector<bool> seen(modules_.size(), false);
  for (const ModuleMemoryUsage& e : heartbeat.memory) {
    if (m.memory.size() >= modules_.size()) break;
    auto it = module_index_.find(e.module);
    if (it == module_index_.end() || seen[it->second] || e.resident_bytes < 0 || e.peak_bytes < 0 ||
        e.gathered_bytes < 0) {
      continue;
    }
    seen[it->second] = true;
    m.memory.push_back(e);
    m.gathered_bytes[e.module].Take(e.gathered_bytes);
  }
}

}  // namespace shardcoord::coordinator
