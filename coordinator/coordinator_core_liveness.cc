// CoordinatorCore, part 3: heartbeats, leaves, deaths and what they do to a group (DESIGN 3,
// "Failures"; DESIGN 8), the tick (heartbeat and plan deadlines), pauses and shutdown.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/coordinator_core.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"
#include "coordinator/daemon_metrics.h"
#include "coordinator/text.h"

namespace shardcoord::coordinator {
namespace {

// Decisions an ended job keeps per group (a live one keeps `decision_history`).
constexpr size_t kEndedJobHistory = 16;

}  // namespace

void CoordinatorCore::OnHeartbeat(uint64_t session_id, const v1::Heartbeat& heartbeat) {
  v1::WorkerBundle bundle;  // A heartbeat alone is a bundle of one (the same locking).
  *bundle.mutable_heartbeat() = heartbeat;
  OnBundle(session_id, bundle);
}

void CoordinatorCore::TakeHeartbeat(Job& job, Member& m, const v1::Heartbeat& heartbeat) {
  TakeMemberHeartbeat(job.groups[m.group], m, heartbeat);
  if (heartbeat.comms_size() > 0) RecordProgress(job, m.rank, heartbeat, m.last_seen);
}

void CoordinatorCore::TakeMemberHeartbeat(const Group& group, Member& m, const v1::Heartbeat& heartbeat) {
  m.last_seen = clock_->Now();
  m.decision_stalls.Take(heartbeat.decision_stalls());
  m.decision_stall_us.Take(heartbeat.decision_stall_us());
  if (heartbeat.memory_size() == 0) return;
  // Bounded by the manifest whatever the client sends: one entry per module of the group's
  // manifest (the first for each), no negative counts; the rest is not kept. A rank's
  // reports then cost no more than its share of the manifest (DESIGN 11).
  m.memory.clear();
  std::vector<bool> seen(group.modules.size(), false);
  for (const auto& e : heartbeat.memory()) {
    if (m.memory.size() >= group.modules.size()) break;
    auto it = group.module_index.find(e.module());
    if (it == group.module_index.end() || seen[it->second] || e.resident_bytes() < 0 || e.peak_bytes() < 0 ||
        e.gathered_bytes() < 0) {
      continue;
    }
    seen[it->second] = true;
    m.memory.push_back(e);
    m.gathered_bytes[e.module()].Take(e.gathered_bytes());
  }
}

void CoordinatorCore::OnGoodbye(uint64_t session_id, const std::string& reason) {
  Locked lock(this);
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;
  RemoveMember(*job, *m, /*clean=*/true,
               reason.empty() ? std::string("left cleanly") : absl::StrCat("left cleanly: ", Printable(reason)));
}

void CoordinatorCore::OnSessionClosed(uint64_t session_id, const std::string& why) {
  Locked lock(this);
  if (shut_down_) return;  // Our own shutdown closed it: no rank died.
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) {
    sessions_.erase(session_id);
    return;
  }
  RemoveMember(*job, *m, /*clean=*/false, absl::StrCat("session stream lost (", why, ")"));
}

void CoordinatorCore::RemoveMember(Job& job, Member& m, bool clean, const std::string& reason) {
  Group& group = job.groups[m.group];
  const std::string full = absl::StrCat("rank ", m.rank, " ", clean ? "" : "declared dead: ", reason);
  // Flush what it was owed, then detach it.
  if (m.sink) {
    if (m.outgoing.has_decisions()) {
      SinkSend(m, m.outgoing);
      m.outgoing.Clear();
    }
    m.sink->Close(clean ? absl::OkStatus() : absl::AbortedError(full));
  }
  m.sink.reset();
  sessions_.erase(m.session);
  m.session_key.clear();
  m.state = clean ? v1::RANK_STATE_LEFT : v1::RANK_STATE_DEAD;
  m.dead_reason = reason;
  Event(clean ? "info" : "error", clean ? EventKind::kRankLeft : EventKind::kRankDead, job.id, m.rank, group.index,
        full);
  if (!clean) metrics_->ObserveDeathDetection(clock_->Now() - m.last_seen);
  MaybeEndJob(job);
  OnMemberLost(job, m.rank, clean, full);
  if (clean) {
    OnLeft(job, group, m);
  } else {
    FailGroup(job, group, m, full);
  }
}

void CoordinatorCore::MaybeEndJob(Job& job) {
  if (std::any_of(job.members.begin(), job.members.end(),
                  [](const Member& x) { return x.state == v1::RANK_STATE_LIVE; })) {
    return;
  }
  job.ended = clock_->Now();  // Kept for `job_retention`, then forgotten.
  // An ended job is kept to be looked at, not to decide: its groups keep their last few
  // decisions only (up to max_jobs ended jobs may wait for eviction at once).
  for (Group& g : job.groups) {
    while (g.history.size() > kEndedJobHistory) g.history.pop_front();
    g.history.shrink_to_fit();
  }
}

void CoordinatorCore::OnLeft(Job& job, Group& group, const Member& m) {
  // Pending microbatches it never reported can never be decided.
  const int idx = static_cast<int>(
      std::lower_bound(group.ranks.begin(), group.ranks.end(), m.rank) - group.ranks.begin());
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
  Flush(job, group);
}

void CoordinatorCore::FailGroup(Job& job, Group& group, const Member& m, const std::string& full) {
  // A death fails the group: cancel everything pending and tell every live member.
  const bool was_failed = group.state == v1::GROUP_STATE_FAILED;
  if (group.state == v1::GROUP_STATE_RECOVERING) {
    // The recovery is over: what the members resumed with is held no longer (nor charged).
    for (int r : group.ranks) {
      job.members[r].resume.reset();
      job.members[r].resume_charge = BufferCharge();
    }
    group.recovery_deadline = absl::InfiniteFuture();
  }
  v1::CoordinatorMessage msg;
  auto* gf = msg.mutable_group_failure();
  gf->set_group(group.index);
  gf->set_epoch(group.epoch);
  for (int r : group.ranks) {
    if (job.members[r].state == v1::RANK_STATE_DEAD) gf->add_dead_ranks(r);
  }
  for (const auto& [k, p] : group.pending) ToProto(k, gf->add_cancelled());
  group.pending.clear();
  for (int r : group.ranks) job.members[r].pending = 0;
  group.failure_reason =
      was_failed && !group.failure_reason.empty() ? absl::StrCat(group.failure_reason, "; ", full) : full;
  gf->set_reason(absl::StrCat("group ", group.index, " of job '", job.id, "' failed at epoch ",
                              group.epoch, ": ", group.failure_reason));
  UpdateGroupState(job, group);
  for (int r : group.ranks) SendTo(job.members[r], msg);
  Event("error", EventKind::kGroupFailed, job.id, m.rank, group.index,
        absl::StrCat(gf->reason(), "; cancelled ", gf->cancelled_size(), " pending microbatches"));
  NotifyRankLost(job, group, m.rank, gf->reason());
}

void CoordinatorCore::NotifyRankLost(Job& job, const Group& group, int rank, const std::string& reason) {
  // The rest of the job (DESIGN 3): collectives that span groups include the dead rank too.
  if (job.groups.size() < 2) return;
  v1::CoordinatorMessage msg;
  auto* n = msg.mutable_notice();
  n->set_kind(v1::Notice::KIND_RANK_LOST);
  n->set_group(group.index);
  n->set_epoch(group.epoch);
  n->set_rank(rank);
  n->set_message(reason);
  for (Member& other : job.members) {
    if (other.group != group.index && other.state == v1::RANK_STATE_LIVE) SendTo(other, msg);
  }
}

void CoordinatorCore::Tick(absl::Time started) {
  Locked lock(this);
  const absl::Time now = clock_->Now();
  if (started != absl::InfinitePast() && now - started > options_.heartbeat_timeout / 2) {
    // Stopped between the ticker's gap check and here (waiting for the lock, say): a pause,
    // not silence. Heartbeats held up meanwhile arrive now.
    RestartHeartbeatDeadlines(now - started);
  }
  EvictEndedJobs(now);
  for (auto& [id, job] : jobs_) {
    ExpireRecovery(*job, now);
    for (Member& m : job->members) {
      if (m.state != v1::RANK_STATE_LIVE) continue;
      if (!m.cut_reason.empty()) {
        RemoveMember(*job, m, /*clean=*/false, std::string(m.cut_reason));
        continue;
      }
      absl::Duration silent = now - m.last_seen;
      if (silent > options_.heartbeat_timeout) {
        RemoveMember(*job, m, /*clean=*/false,
                     absl::StrCat("no heartbeat for ", absl::ToInt64Milliseconds(silent),
                                  " ms (heartbeat timeout ",
                                  absl::ToInt64Milliseconds(options_.heartbeat_timeout), " ms)"));
      }
    }
    for (Group& group : job->groups) {
      std::vector<std::pair<MicrobatchKey, absl::Status>> expired;
      for (const auto& [k, p] : group.pending) {
        absl::Duration waited = now - p.first_report;
        if (waited <= options_.plan_timeout) continue;
        std::vector<int> missing, have;
        for (size_t i = 0; i < group.ranks.size(); ++i) {
          (p.reported[i] ? have : missing).push_back(group.ranks[i]);
        }
        expired.emplace_back(k, absl::DeadlineExceededError(absl::StrCat(
            "group ", group.index, " waited ", absl::ToInt64Milliseconds(waited),
            " ms for the plan of ", k.ToString(), " from ranks ", RankList(missing), " (ranks ",
            RankList(have), " reported it); plan timeout is ",
            absl::ToInt64Milliseconds(options_.plan_timeout),
            " ms: raise --plan-timeout-ms if ranks legitimately fall this far behind")));
      }
      for (auto& [k, s] : expired) FailMicrobatch(*job, group, k, s);
      if (!expired.empty()) Flush(*job, group);
    }
    ExpireCommWaiters(*job, now);
    DetectBehind(*job, now);
  }
}

void CoordinatorCore::OnPaused(absl::Duration gap) {
  Locked lock(this);
  RestartHeartbeatDeadlines(gap);
}

void CoordinatorCore::RestartHeartbeatDeadlines(absl::Duration gap) {
  const absl::Time now = clock_->Now();
  int extended = 0;
  for (auto& [id, job] : jobs_) {
    for (Member& m : job->members) {
      if (m.state != v1::RANK_STATE_LIVE) continue;
      m.last_seen = std::max(m.last_seen, now);
      extended++;
    }
  }
  const std::string what = absl::StrCat("the coordinator did not run for ", absl::ToInt64Milliseconds(gap),
                                        " ms (paused, starved or the clock jumped); heartbeat deadlines of ",
                                        extended, " live ranks restarted instead of declaring them dead");
  Event("warning", EventKind::kCoordinatorPaused, "", -1, -1, what);
}

void CoordinatorCore::RecordDaemonEvent(bool started, const std::string& detail) {
  Locked lock(this);
  Event("info", started ? EventKind::kDaemonStarted : EventKind::kDaemonStopped, "", -1, -1,
        absl::StrCat("shardcoord ", kVersion, " incarnation ", incarnation_, ": ", detail));
}

void CoordinatorCore::Shutdown() {
  Locked lock(this);
  shut_down_ = true;
  FailAllCommWaiters(absl::UnavailableError("coordinator is shutting down"));
  v1::CoordinatorMessage notice;
  notice.mutable_notice()->set_kind(v1::Notice::KIND_SHUTDOWN);
  notice.mutable_notice()->set_message("coordinator is shutting down");
  for (auto& [id, job] : jobs_) {
    for (Member& m : job->members) {
      if (m.state != v1::RANK_STATE_LIVE || !m.sink) continue;
      SendTo(m, notice);
      m.sink->Close(absl::UnavailableError("coordinator is shutting down"));
      m.sink.reset();
    }
  }
}

}  // namespace shardcoord::coordinator
