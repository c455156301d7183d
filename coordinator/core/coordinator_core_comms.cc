// CoordinatorCore: communicators (DESIGN 4). Each job's are in its CommTable
// (comm_table.h); here the core checks who calls, and answers the table's questions about
// the job's members (JobHost).
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/secrets.h"
#include "coordinator/engine/text.h"

namespace shardcoord::coordinator {

// The core as its communicators see it: one job's members, sends, events and completions.
// Made only under mu_ exclusive (its constructor requires it) and used before that is released:
// the CommTable call it is passed to requires the same lock (`held`), and each of its answers
// requires it too, so the compiler checks each body. The one step it cannot follow is the call
// through CommHost's interface, from a CommTable method that holds the lock by its requirement.
class CoordinatorCore::JobHost final : public CommHost {
 public:
  JobHost(CoordinatorCore& core, Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core.mu_) : core_(core), job_(job) {}
  absl::Time Now() const override { return core_.clock_->Now(); }
  v1::RankState StateOf(int rank) const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu_) {
    GroupSlot& slot = SlotOf(job_, rank);
    HeldGroup held(job_, slot);
    return slot.group.member(rank).state;
  }
  std::string DeadReasonOf(int rank) const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu_) {
    GroupSlot& slot = SlotOf(job_, rank);
    HeldGroup held(job_, slot);
    return slot.group.member(rank).dead_reason;
  }
  void Send(int rank, const v1::CoordinatorMessage& msg) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu_) {
    GroupSlot& slot = SlotOf(job_, rank);
    HeldGroup held(job_, slot);
    core_.SendTo(slot.group.member(rank), slot.group.binding(rank), msg);
  }
  void Event(Severity severity, EventKind kind, int rank, const std::string& message) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu_) {
    core_.Event(severity, kind, job_.id, rank, -1, message);
  }
  void Defer(std::function<void()> f) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu_) {
    core_.mu_.Defer(std::move(f));
  }

 private:
  CoordinatorCore& core_;
  Job& job_;
};

namespace {

absl::Status NotALiveRank(const std::string& job_id, int rank) {
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, " of job '", Printable(job_id, 64), "' is not a live registered rank; register it before "
      "using communicators"));
}

}  // namespace

absl::StatusOr<Job*> CoordinatorCore::CommCaller(const CommCallerId& caller) {
  const std::string& job_id = caller.job_id;
  const int rank = caller.rank;
  Job* found = jobs_.Find(job_id);
  if (found == nullptr) {
    return absl::NotFoundError(absl::StrCat("no job '", Printable(job_id, 64), "': register the rank first"));
  }
  Job& job = *found;
  if (rank < 0 || rank >= job.world_size) return NotALiveRank(job_id, rank);
  GroupSlot& slot = SlotOf(job, rank);
  HeldGroup held(job, slot);
  if (slot.group.member(rank).state != v1::RANK_STATE_LIVE) return NotALiveRank(job_id, rank);
  if (!SameSecret(caller.session_key, slot.group.binding(rank).session_key)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", rank, " of job '", Printable(job_id, 64), "': this call does not come from the rank's live session "
        "(session_key missing or wrong); communicator calls are accepted only from the worker that registered the rank"));
  }
  return &job;
}

void CoordinatorCore::CommJoin(const CommJoinCall& call, JoinDone done) {
  CoreLock lock(&mu_);
  absl::StatusOr<Job*> job =
      shut_down_ ? absl::UnavailableError("coordinator is shutting down") : CommCaller(call.caller);
  if (!job.ok()) {
    mu_.Defer([done = std::move(done), s = job.status()] { done(s); });
    return;
  }
  JobHost host(*this, **job);
  (*job)->comms->Join(host, mu_, call, std::move(done));
}

absl::Status CoordinatorCore::StoreSet(StoreSetCall call) {
  CoreLock lock(&mu_);
  absl::StatusOr<Job*> job = CommCaller(call.caller);
  if (!job.ok()) return job.status();
  JobHost host(*this, **job);
  return (*job)->comms->Set(host, mu_, std::move(call));
}

void CoordinatorCore::StoreGet(StoreGetCall call, GetDone done) {
  CoreLock lock(&mu_);
  // Shutting down: no ticker will expire a waiter any more.
  absl::StatusOr<Job*> job =
      shut_down_ ? absl::UnavailableError("coordinator is shutting down") : CommCaller(call.caller);
  if (!job.ok()) {
    mu_.Defer([done = std::move(done), s = job.status()] { done(s); });
    return;
  }
  JobHost host(*this, **job);
  (*job)->comms->Get(host, mu_, std::move(call), std::move(done));
}

absl::Status CoordinatorCore::CommReport(const CommReportCall& call) {
  CoreLock lock(&mu_);
  absl::StatusOr<Job*> job = CommCaller(call.caller);
  if (!job.ok()) return job.status();
  JobHost host(*this, **job);
  return (*job)->comms->Report(host, mu_, call);
}

void CoordinatorCore::TakeCommAborted(Job& job, const Member& m, const CommAbortAck& ack) {
  {
    GroupSlot& slot = *job.groups[m.group];
    HeldGroup held(job, slot);
    slot.group.MemberSeen(m.rank, clock_->Now());
  }
  JobHost host(*this, job);
  job.comms->AckAbort(host, mu_, ack, m.rank);
}

void CoordinatorCore::OnMemberLost(Job& job, int rank, bool clean, const std::string& reason) {
  JobHost host(*this, job);
  job.comms->OnRankLost(host, mu_, rank, clean, reason);
}

void CoordinatorCore::OnMemberBack(Job& job, int rank) {
  JobHost host(*this, job);
  job.comms->OnRankBack(host, mu_, rank);
}

void CoordinatorCore::TickComms(Job& job, absl::Time now) {
  JobHost host(*this, job);
  job.comms->Tick(host, mu_, now);
}

void CoordinatorCore::ResumeComms(Job& job, int rank, const v1::ResumeState& state) {
  JobHost host(*this, job);
  job.comms->Resume(host, mu_, rank, state);
}

void CoordinatorCore::FailAllCommWaiters(const absl::Status& why) {
  for (auto& [id, job] : jobs_) {
    JobHost host(*this, *job);
    job->comms->FailAllWaiters(host, mu_, why);
  }
}

}  // namespace shardcoord::coordinator
