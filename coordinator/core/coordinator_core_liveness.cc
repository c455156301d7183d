// CoordinatorCore: what a session sends after registering (bundles: heartbeats, abort
// acknowledgements, plans), leaves and deaths (DESIGN 3, "Failures"), the tick (heartbeat and
// plan deadlines, job retention), pauses and shutdown.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/daemon_metrics.h"
#include "coordinator/engine/text.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"

namespace shardcoord::coordinator {
namespace {

// Decisions an ended job keeps per group (a live one keeps `decision_history`).
constexpr size_t kEndedJobHistory = 16;

}  // namespace

void CoordinatorCore::OnBundle(uint64_t session_id, const WorkerReport& report) {
  if (!report.comm_aborted.empty()) {
    // Acknowledgements change the state of the job's communicators.
    CoreLock lock(&mu_);
    Job* job = nullptr;
    const Member* m = LiveMember(session_id, &job);
    if (m == nullptr) return;
    GroupSlot& slot = *job->groups[m->group];
    HeldGroup held(*job, slot);
    if (report.heartbeat) TakeHeartbeat(*job, slot.group, *m, *report.heartbeat);
    for (const CommAbortAck& ack : report.comm_aborted) TakeCommAborted(*job, *m, ack);
    if (report.plans) TakePlans(*job, slot.group, *m, *report.plans);
    return;
  }
  // The hot path: this group only.
  CoreReaderLock lock(&mu_);
  const SessionRef* ref = jobs_.FindSession(session_id);
  if (ref == nullptr) return;  // A stale session; its rank re-registered or was declared dead.
  GroupSlot& slot = SlotOf(*ref->job, ref->rank);
  GroupLock group_lock(&slot.mu);
  const Member* m = LiveIn(slot.group, ref->rank, session_id);
  if (m == nullptr) return;
  if (report.heartbeat) TakeHeartbeat(*ref->job, slot.group, *m, *report.heartbeat);
  if (report.plans) TakePlans(*ref->job, slot.group, *m, *report.plans);
}

void CoordinatorCore::TakeHeartbeat(Job& job, ShardGroup& group, const Member& m, const HeartbeatReport& heartbeat) {
  const absl::Time now = clock_->Now();
  GroupEffects fx;
  group.TakeHeartbeat(group.IndexOf(m.rank), heartbeat, now, fx);
  // Collective progress: under the communicator table's own (leaf) mutex.
  if (!heartbeat.comms.empty()) job.comms->RecordProgress(m.rank, heartbeat.comms, now);
  Apply(job, group, fx);
}

void CoordinatorCore::TakePlans(Job& job, ShardGroup& group, const Member& m, const PlanBatchReport& batch) {
  GroupEffects& fx = group.effects();  // Reused: Apply empties it, keeping its room.
  group.TakePlans(group.IndexOf(m.rank), batch, clock_->Now(), fx);
  Apply(job, group, fx);
}

void CoordinatorCore::OnGoodbye(uint64_t session_id, const std::string& reason, bool failed) {
  CoreLock lock(&mu_);
  Job* job = nullptr;
  const Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;
  if (failed) {  // The trainer stopped on an error: its group fails now, naming it and the error.
    RemoveMember(*job, *m, Leaving::kFailed,
                 absl::StrCat("failed: ", reason.empty() ? std::string("stopped on an error") : Printable(reason)));
    return;
  }
  RemoveMember(*job, *m, Leaving::kClean,
               reason.empty() ? std::string("left cleanly") : absl::StrCat("left cleanly: ", Printable(reason)));
}

void CoordinatorCore::OnSessionClosed(uint64_t session_id, const std::string& why) {
  CoreLock lock(&mu_);
  if (shut_down_) return;  // Our own shutdown closed it: no rank died.
  Job* job = nullptr;
  const Member* m = LiveMember(session_id, &job);
  if (m == nullptr) {
    jobs_.ForgetSession(session_id);
    return;
  }
  // A rank already found not reading (or breaking the protocol) whose stream ends before the
  // tick fails it: the finding is the cause, not the end of the stream it led to.
  GroupSlot& slot = SlotOf(*job, m->rank);
  HeldGroup held(*job, slot);
  const std::string cut = slot.group.binding(m->rank).cut_reason;
  RemoveMember(*job, *m, Leaving::kDead, cut.empty() ? absl::StrCat("session stream lost (", why, ")") : std::string(cut));
}

void CoordinatorCore::RemoveMember(Job& job, const Member& m, Leaving how, const std::string& reason) {
  GroupSlot& slot = *job.groups[m.group];
  HeldGroup held(job, slot);
  ShardGroup& group = slot.group;
  const bool clean = how == Leaving::kClean;
  // "rank 1 left cleanly", "rank 1 failed: ERROR" (its trainer said so), "rank 1 declared dead: WHY".
  const std::string full = absl::StrCat("rank ", m.rank, " ", how == Leaving::kDead ? "declared dead: " : "", reason);
  // Flush what it was owed, then detach it. A dead rank whose write is stuck is cut for it
  // too: its queue is dropped at once instead of staying charged until its TCP goes.
  SessionBinding& b = group.binding(m.rank);
  if (b.sink && how == Leaving::kDead && BacklogOf(*b.sink).stalled_since < clock_->Now() - kNotReadingGrace) {
    b.sink->CutForNotReading();
  }
  if (b.sink) {
    SendBatched(b);
    b.sink->Close(clean ? absl::OkStatus() : absl::AbortedError(full));
  }
  b.sink.reset();
  jobs_.ForgetSession(b.session);
  b.session_key.clear();
  group.MemberGone(m.rank, clean, reason);
  Event(clean ? Severity::kInfo : Severity::kError, clean ? EventKind::kRankLeft : EventKind::kRankDead, job.id, m.rank, group.index(),
        full);
  if (how == Leaving::kDead) metrics_->ObserveDeathDetection(clock_->Now() - m.last_seen);
  MaybeEndJob(job);
  OnMemberLost(job, m.rank, clean, full);
  if (clean) {
    GroupEffects fx;
    group.OnLeft(group.IndexOf(m.rank), clock_->Now(), fx);
    Apply(job, group, fx);
  } else {
    FailGroup(job, group, group.IndexOf(m.rank), full);
  }
}

RankSink::Backlog CoordinatorCore::BacklogOf(const RankSink& sink) const {
  RankSink::Backlog b = sink.backlog();
  b.stalled_since = std::max(b.stalled_since, last_pause_end_);  // The daemon's own pause is no rank's.
  return b;
}

void CoordinatorCore::ReclaimBuffers(absl::Time now) {
  // The ranks whose write has waited for them to read: the biggest holders first, while the
  // daemon's buffers are over the limit (the ranks that read may have taken past it); and any
  // that has not read for a heartbeat timeout, whatever the budget (a rank that heartbeats but
  // never reads held its bytes for as long as it lived).
  struct Holder {
    Job* job;
    int rank;
    RankSink::Backlog b;
  };
  std::vector<Holder> stalled;
  for (auto& entry : jobs_) {
    Job* job = entry.second.get();
    ForEachMember(*job, [&](const Member& m, SessionBinding& to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (!m.live() || !to.sink || !to.cut_reason.empty()) return;
      const RankSink::Backlog b = BacklogOf(*to.sink);
      if (b.stalled_since < now - kNotReadingGrace) stalled.push_back({job, m.rank, b});
    });
  }
  std::sort(stalled.begin(), stalled.end(), [](const Holder& a, const Holder& b) { return a.b.charged > b.b.charged; });
  int64_t over = buffers_->used() - buffers_->limit();
  for (const Holder& h : stalled) {
    const absl::Duration waited = now - h.b.stalled_since;
    // Over the budget, the holders of queued bytes; whatever the budget, a write stuck longer
    // than the heartbeat timeout (its bytes in flight are not in `charged`).
    if ((over <= 0 || h.b.charged == 0) && waited <= options_.heartbeat_timeout) continue;
    GroupSlot& slot = SlotOf(*h.job, h.rank);
    HeldGroup held(*h.job, slot);
    SessionBinding& to = slot.group.binding(h.rank);
    to.cut_reason = absl::StrCat(
        "not reading its session stream: ", h.b.charged, " bytes queued for it have waited ",
        absl::ToInt64Milliseconds(waited), " ms for it to read",
        over > 0 ? absl::StrCat(" while the daemon's buffers for all clients are over their limit (max_buffered_bytes ",
                                buffers_->limit(), ")")
                 : absl::StrCat(", longer than the heartbeat timeout (", absl::ToInt64Milliseconds(
                                                                            options_.heartbeat_timeout), " ms)"),
        "; a rank must keep reading its decisions");
    to.sink->CutForNotReading();
    over -= h.b.charged;
  }
}

void CoordinatorCore::ExpireForming(Job& job, absl::Time now) {
  if (job.has_ended() || now - job.started <= options_.limits.form_timeout) return;
  std::vector<int> never;  // The ranks of groups that never formed that never registered.
  bool forming = false;
  for (const auto& slot : job.groups) {
    HeldGroup held(job, *slot);
    ShardGroup& g = slot->group;  // Not const: the analysis follows a reference only without a conversion.
    if (g.formed()) continue;
    forming = true;
    for (const Member& m : g.members()) {
      if (m.state == v1::RANK_STATE_UNREGISTERED) never.push_back(m.rank);
    }
  }
  if (!forming) return;
  const std::string why = absl::StrCat(
      "job '", job.id, "' did not form within form_timeout_ms (", absl::ToInt64Milliseconds(options_.limits.form_timeout),
      " ms): ", never.size(), " of its ", job.world_size, " ranks never registered (", RankList(never),
      "); start every rank of the job, or give them longer (form_timeout_ms)");
  ForEachMember(job, [&](const Member& m, SessionBinding&) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (m.live()) RemoveMember(job, m, Leaving::kDead, why);
  });
}

void CoordinatorCore::MaybeEndJob(Job& job) {
  for (const auto& slot : job.groups) {
    HeldGroup held(job, *slot);
    if (slot->group.Count().live > 0) return;
  }
  job.ended = clock_->Now();  // Kept for `job_retention`, then forgotten.
  // An ended job is kept to be looked at, not to decide: its groups keep their last few
  // decisions only (up to max_jobs ended jobs may wait for eviction at once).
  for (const auto& slot : job.groups) {
    HeldGroup held(job, *slot);
    slot->group.TrimHistory(kEndedJobHistory);
  }
}

void CoordinatorCore::Tick(absl::Time started) {
  CoreLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (started != absl::InfinitePast() && now - started > options_.heartbeat_timeout / 2) {
    // Stopped between the ticker's gap check and here (waiting for the lock, say): a pause,
    // not silence. Heartbeats held up meanwhile arrive now.
    RestartHeartbeatDeadlines(now - started);
  }
  for (const JobTable::Forgotten& f : jobs_.ForgetEnded(now, options_.limits.job_retention)) {
    Event(Severity::kInfo, EventKind::kJobEvicted, f.id, -1, -1, f.why);
  }
  ReclaimBuffers(now);  // Sets cut_reason: the members are removed in the loop below.
  for (auto& entry : jobs_) {
    Job* job = entry.second.get();
    ExpireRecovery(*job, now);
    ExpireForming(*job, now);
    ForEachMember(*job, [&](const Member& m, SessionBinding& to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (!m.live()) return;
      if (!to.cut_reason.empty()) {
        RemoveMember(*job, m, Leaving::kDead, std::string(to.cut_reason));
        return;
      }
      absl::Duration silent = now - m.last_seen;
      if (silent > options_.heartbeat_timeout) {
        RemoveMember(*job, m, Leaving::kDead,
                     absl::StrCat("no heartbeat for ", absl::ToInt64Milliseconds(silent),
                                  " ms (heartbeat timeout ",
                                  absl::ToInt64Milliseconds(options_.heartbeat_timeout), " ms)"));
      }
    });
    for (const auto& slot : job->groups) {
      HeldGroup held(*job, *slot);
      GroupEffects fx;
      slot->group.ExpirePlans(now, fx);
      Apply(*job, slot->group, fx);
    }
    TickComms(*job, now);
  }
  SyncRunPins();  // Jobs that ended or were forgotten, pins no resume claimed.
}

void CoordinatorCore::OnPaused(absl::Duration gap) {
  CoreLock lock(&mu_);
  RestartHeartbeatDeadlines(gap);
}

void CoordinatorCore::RestartHeartbeatDeadlines(absl::Duration gap) {
  const absl::Time now = clock_->Now();
  last_pause_end_ = now;  // Writes waiting across the pause waited for the daemon, not their ranks.
  int extended = 0;
  for (auto& [id, job] : jobs_) {
    for (const auto& slot : job->groups) {
      HeldGroup held(*job, *slot);
      extended += slot->group.RestartHeartbeatDeadlines(now);
    }
  }
  const std::string what = absl::StrCat("the coordinator did not run for ", absl::ToInt64Milliseconds(gap),
                                        " ms (paused, starved or the clock jumped); heartbeat deadlines of ",
                                        extended, " live ranks restarted instead of declaring them dead");
  Event(Severity::kWarning, EventKind::kCoordinatorPaused, "", -1, -1, what);
}

void CoordinatorCore::Shutdown() {
  CoreLock lock(&mu_);
  shut_down_ = true;
  FailAllCommWaiters(absl::UnavailableError("coordinator is shutting down"));
  v1::CoordinatorMessage notice;
  notice.mutable_notice()->set_kind(v1::Notice::KIND_SHUTDOWN);
  notice.mutable_notice()->set_message("coordinator is shutting down");
  for (auto& [id, job] : jobs_) {
    ForEachMember(*job, [&](const Member& m, SessionBinding& to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (!m.live() || !to.sink) return;
      SendTo(m, to, notice);
      to.sink->Close(absl::UnavailableError("coordinator is shutting down"));
      to.sink.reset();
    });
  }
}

}  // namespace shardcoord::coordinator
