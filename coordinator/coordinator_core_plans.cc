// CoordinatorCore, part 2: plan intake, decisions and their fan-out (DESIGN 3).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/coordinator_core.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"
#include "coordinator/daemon_metrics.h"
#include "coordinator/text.h"

namespace shardcoord::coordinator {

CoordinatorCore::Member* CoordinatorCore::LiveMember(uint64_t session_id, Job** job) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return nullptr;
  Member& m = it->second.job->members[it->second.rank];
  if (m.session != session_id || m.state != v1::RANK_STATE_LIVE) return nullptr;
  *job = it->second.job;
  return &m;
}

bool CoordinatorCore::WillNeverReport(const Member& m, const MicrobatchKey& key) const {
  if (m.state == v1::RANK_STATE_LEFT) return !m.last_planned || *m.last_planned < key;
  return m.last_planned && key < *m.last_planned;
}

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

void CoordinatorCore::OnPlans(uint64_t session_id, const v1::PlanBatch& batch) {
  SharedLocked lock(this);
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;  // A stale session; its rank re-registered or was declared dead.
  absl::MutexLock group_lock(job->groups[m->group].mu.get());
  TakePlans(*job, *m, batch);
}

void CoordinatorCore::OnBundle(uint64_t session_id, const v1::WorkerBundle& bundle) {
  if (bundle.comm_aborted_size() > 0 || bundle.heartbeat().comms_size() > 0) {
    // Acknowledgements and collective progress change the job's communicators.
    Locked lock(this);
    Job* job = nullptr;
    Member* m = LiveMember(session_id, &job);
    if (m == nullptr) return;
    if (bundle.has_heartbeat()) TakeHeartbeat(*job, *m, bundle.heartbeat());
    for (const auto& ack : bundle.comm_aborted()) TakeCommAborted(*job, *m, ack);
    if (bundle.has_plans()) TakePlans(*job, *m, bundle.plans());
    return;
  }
  SharedLocked lock(this);
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;
  absl::MutexLock group_lock(job->groups[m->group].mu.get());
  if (bundle.has_heartbeat()) TakeMemberHeartbeat(job->groups[m->group], *m, bundle.heartbeat());
  if (bundle.has_plans()) TakePlans(*job, *m, bundle.plans());
}

void CoordinatorCore::TakePlans(Job& job, Member& m, const v1::PlanBatch& batch) {
  m.last_seen = clock_->Now();
  Group& group = job.groups[m.group];
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
                         ? AcceptPlan(job, m, plan)
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
  Flush(job, group);
}

absl::Status CoordinatorCore::AcceptPlan(Job& job, Member& m, const v1::MicrobatchPlan& plan) {
  Group& group = job.groups[m.group];
  const MicrobatchKey key{plan.step(), plan.microbatch()};
  const std::string who = absl::StrCat("rank ", m.rank, " (job '", job.id, "', group ", group.index, ")");
  absl::StatusOr<PlanCalls> calls = ParsePlan(group, plan, key, who);
  if (!calls.ok()) return calls.status();
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

  const int idx = static_cast<int>(std::lower_bound(group.ranks.begin(), group.ranks.end(), m.rank) -
                                   group.ranks.begin());
  if (group.engine->is_static()) return AcceptStaticPlan(job, group, m, key, idx);

  if (group.last_resolved && key <= *group.last_resolved && !group.pending.count(key)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "plan ", key.ToString(), " from ", who, " is stale: group ", group.index,
        " already resolved every microbatch up to ", group.last_resolved->ToString()));
  }
  if (m.pending >= m.lookahead) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "plan ", key.ToString(), " from ", who, " is beyond the lookahead window: ", m.pending,
        " plans are undecided and the window is ", m.lookahead,
        "; wait for the oldest decision before planning further ahead"));
  }
  if (!group.pending.count(key)) {
    if (absl::Status s = CheckPendingRoom(group, key, who); !s.ok()) return s;
  }

  // Accepted.
  const bool inserted = RecordPlan(job, group, m, key, idx, *calls);
  if (!FailSkipped(job, group, m, key, idx, inserted)) return absl::OkStatus();
  DrainGroup(job, group);
  return absl::OkStatus();
}

absl::StatusOr<CoordinatorCore::PlanCalls> CoordinatorCore::ParsePlan(const Group& group,
                                                                      const v1::MicrobatchPlan& plan,
                                                                      const MicrobatchKey& key,
                                                                      const std::string& who) const {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("plan ", key.ToString(), " from ", who, ": ", what));
  };
  if (std::string e = CheckPlanKey(key); !e.empty()) return bad(e);
  PlanCalls calls;
  calls.reserve(plan.calls_size());
  for (const auto& [name, count] : plan.calls()) {
    auto mi = group.module_index.find(name);
    const bool known = mi != group.module_index.end();
    std::vector<std::string> registered;
    if (!known) {
      for (const auto& spec : group.modules) registered.push_back(spec.name);
    }
    if (std::string e = CheckPlanCall(name, count, known, registered); !e.empty()) return bad(e);
    calls.emplace_back(mi->second, count);
  }
  return calls;
}

bool CoordinatorCore::RecordPlan(Job& job, Group& group, Member& m, const MicrobatchKey& key, int idx,
                                 const PlanCalls& calls) {
  m.last_planned = key;
  m.plans_received++;
  job.plans_received++;
  const int size = static_cast<int>(group.ranks.size());
  auto [it, inserted] = group.pending.try_emplace(key);
  PendingMicrobatch& p = it->second;
  if (inserted) {
    p.calls.assign(group.modules.size(), std::vector<int32_t>(size, 0));
    p.reported.assign(size, false);
    p.first_report = clock_->Now();
  }
  for (const auto& [mi, count] : calls) p.calls[mi][idx] = count;
  if (!p.reported[idx]) {  // A rank that left and came back may report a pending key again.
    p.reported[idx] = true;
    p.num_reported++;
    m.pending++;
  }
  return inserted;
}

absl::Status CoordinatorCore::CheckPendingRoom(const Group& group, const MicrobatchKey& key,
                                              const std::string& who) const {
  if (static_cast<int>(group.pending.size()) < options_.limits.max_pending_microbatches) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "plan ", key.ToString(), " from ", who, ": group ", group.index, " already holds ", group.pending.size(),
      " microbatches that some ranks reported and others not yet (max_pending_microbatches); the ranks of "
      "the group are too far apart: wait for the slowest, or raise --max-pending-microbatches"));
}

bool CoordinatorCore::FailSkipped(Job& job, Group& group, Member& m, const MicrobatchKey& key, int idx,
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
    if (!p.reported[i] && WillNeverReport(job.members[group.ranks[i]], key)) never.push_back(group.ranks[i]);
  }
  if (never.empty()) return true;
  FailMicrobatch(job, group, key, absl::FailedPreconditionError(absl::StrCat(
      "microbatch ", key.ToString(), " of group ", group.index, " can never be decided: ranks ", RankList(never),
      " already planned later microbatches or left; every rank of a shard group must run the same microbatches")));
  return false;
}

absl::Status CoordinatorCore::AcceptStaticPlan(Job& job, Group& group, Member& m, const MicrobatchKey& key,
                                               int idx) {
  // root / replicate: the rank gets its decision at once, without waiting for the group.
  // The decision (and its seq) is made once per key, when the first rank reports it, so every
  // rank of the group receives the identical decision; the key stays pending until every rank
  // reported it, which is how a rank that skips a microbatch is caught (the microbatch fails
  // for the whole group, as under auto).
  const std::string who = absl::StrCat("rank ", m.rank, " (job '", job.id, "', group ", group.index, ")");
  auto it = group.pending.find(key);
  if (it == group.pending.end()) {
    if (group.last_resolved && key <= *group.last_resolved) {
      return absl::FailedPreconditionError(absl::StrCat(
          "plan ", key.ToString(), " from ", who, " is stale: group ", group.index,
          " already resolved every microbatch up to ", group.last_resolved->ToString()));
    }
    if (absl::Status s = CheckPendingRoom(group, key, who); !s.ok()) return s;
  }
  m.last_planned = key;
  m.plans_received++;
  job.plans_received++;
  const int size = static_cast<int>(group.ranks.size());
  const bool inserted = it == group.pending.end();
  if (inserted) {
    it = group.pending.try_emplace(key).first;
    PendingMicrobatch& p = it->second;
    p.reported.assign(size, false);
    p.first_report = clock_->Now();
    v1::MicrobatchDecision pd;
    ToProto(group.engine->DecideStatic(key, group.epoch, group.static_seq++), &pd);
    pd.set_seal(resume_auth_.Seal(job.id, pd));
    pd.set_decided_unix_ms(absl::ToUnixMillis(clock_->Now()));
    RecordDecision(job, group, pd);
    p.decided = std::move(pd);
  }
  PendingMicrobatch& p = it->second;
  if (!p.reported[idx]) {
    p.reported[idx] = true;
    p.num_reported++;
    m.pending++;
  }
  QueueDecision(m, *p.decided);
  if (!FailSkipped(job, group, m, key, idx, inserted)) return absl::OkStatus();
  // Resolved once every rank reported it; entries before it were failed above.
  if (p.num_reported == size) {
    for (int r : group.ranks) {
      if (job.members[r].pending > 0) job.members[r].pending--;
    }
    if (!group.last_resolved || *group.last_resolved < key) group.last_resolved = key;
    group.pending.erase(it);
  }
  return absl::OkStatus();
}

void CoordinatorCore::DrainGroup(Job& job, Group& group) {
  const int size = static_cast<int>(group.ranks.size());
  if (group.state != v1::GROUP_STATE_HEALTHY) return;  // Forming: not everyone can plan yet.
  if (group.engine->is_static()) return;              // Decided as reported (AcceptStaticPlan).
  while (!group.pending.empty()) {
    auto it = group.pending.begin();
    if (it->second.num_reported < size) break;
    std::vector<EngineTransition> transitions;
    MicrobatchDecision d = group.engine->Decide(it->first, group.epoch, it->second.calls, &transitions);
    const absl::Time now = clock_->Now();
    metrics_->ObserveDecisionLatency(now - it->second.first_report);
    v1::MicrobatchDecision pd;
    ToProto(d, &pd);
    pd.set_seal(resume_auth_.Seal(job.id, pd));
    pd.set_decided_unix_ms(absl::ToUnixMillis(now));
    for (int r : group.ranks) {
      Member& mem = job.members[r];
      if (mem.pending > 0) mem.pending--;
      QueueDecision(mem, pd);
    }
    group.last_resolved = it->first;
    group.last_decided = it->first;
    RecordDecision(job, group, pd);
    group.pending.erase(it);
    for (const auto& t : transitions) {
      const EventKind kind = t.what == "promoted"  ? EventKind::kModulePromoted
                             : t.what == "demoted" ? EventKind::kModuleDemoted
                                                   : EventKind::kModuleStickyReplicate;
      Event("info", kind, job.id, -1, group.index,
            absl::StrCat("module '", t.module, "': ", t.detail));
    }
  }
}

namespace {

void CountDecision(const v1::ModuleDecision& md, v1::DecisionCounts* c) {
  switch (md.decision()) {
    case v1::DECISION_PER_LAYER: c->set_per_layer(c->per_layer() + 1); break;
    case v1::DECISION_SKIP: c->set_skip(c->skip() + 1); break;
    case v1::DECISION_ROOT: c->set_root(c->root() + 1); break;
    case v1::DECISION_REPLICATE: c->set_replicate(c->replicate() + 1); break;
    default: break;
  }
  if (md.reason() == v1::REASON_DIVERGENT) c->set_divergent(c->divergent() + 1);
}

}  // namespace

void CoordinatorCore::RecordDecision(Job& job, Group& group, const v1::MicrobatchDecision& d) {
  job.microbatches_decided++;
  for (const auto& md : d.modules()) {
    CountDecision(md, &group.module_counts[md.module()]);
  }
  group.last_decided = MicrobatchKey{d.step(), d.microbatch()};
  group.history.push_back(d);
  while (static_cast<int>(group.history.size()) > options_.decision_history) group.history.pop_front();
}

void CoordinatorCore::QueueDecision(Member& m, const v1::MicrobatchDecision& d) {
  if (m.state != v1::RANK_STATE_LIVE || !m.sink) return;
  *m.outgoing.mutable_decisions()->add_decisions() = d;
}

void CoordinatorCore::Flush(Job& job, const Group& group) {
  for (int r : group.ranks) {
    Member& m = job.members[r];
    if (m.outgoing.has_decisions() && m.outgoing.decisions().decisions_size() > 0) {
      SinkSend(m, m.outgoing);
      m.outgoing.Clear();
    }
  }
}

void CoordinatorCore::SendTo(Member& m, const v1::CoordinatorMessage& msg) {
  if (m.state != v1::RANK_STATE_LIVE || !m.sink) return;
  // Decisions batched so far go first: the rank sees messages in the order produced.
  if (m.outgoing.has_decisions() && m.outgoing.decisions().decisions_size() > 0) {
    SinkSend(m, m.outgoing);
    m.outgoing.Clear();
  }
  SinkSend(m, msg);
}

void CoordinatorCore::SinkSend(Member& m, const v1::CoordinatorMessage& msg) {
  if (!m.sink || !m.cut_reason.empty()) return;
  // Refused: the rank is not reading. Tick fails it (not here: we may be deep inside a
  // group's state change); until then nothing more is queued for it.
  if (absl::Status s = m.sink->Send(msg); !s.ok()) {
    m.cut_reason = std::string(s.message());
    return;
  }
  // The write starts once mu_ is released (see RunDeferred).
  auto& kick = ThisThread().kick;
  if (kick.empty() || kick.back() != m.sink) kick.push_back(m.sink);
}

void CoordinatorCore::FailMicrobatch(Job& job, Group& group, const MicrobatchKey& key,
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
  for (size_t i = 0; i < group.ranks.size(); ++i) {
    Member& mem = job.members[group.ranks[i]];
    if (it->second.reported[i] && mem.pending > 0) mem.pending--;
    SendTo(mem, msg);
  }
  group.pending.erase(it);
  if (!group.last_resolved || *group.last_resolved < key) group.last_resolved = key;
  Event("error", EventKind::kMicrobatchFailed, job.id, -1, group.index, std::string(why.message()));
}

}  // namespace shardcoord::coordinator
