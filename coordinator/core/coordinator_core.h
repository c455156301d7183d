// CoordinatorCore: the coordinator's state and rules, independent of gRPC.
//
// It keeps the registry of jobs, sessions and shard groups, validates registrations,
// detects dead ranks (stream lost, heartbeats missed), runs the communicators (CommTable)
// and answers status queries. Each group's rules (plans, decisions, its state machine,
// recovery) are ShardGroup's: the core calls a group's operation under the group's lock and
// carries out the effects it returns (Apply).
// The gRPC adapter (coordinator_server.cc; the Session streams in session_stream.h)
// converts streams and calls into calls on this class, what a worker sends into the core's
// types (Registration, WorkerReport: wire_intake.h), and gives each session a RankSink
// through which the core sends messages.
//
// Thread-safety: every public method may be called from any thread. The registry (the
// JobTable: jobs, sessions, communicators) is guarded by one reader/writer mutex, `mu_`
// (a CoreMutex, DESIGN 9), held exclusively by everything but the hot path and the status
// queries; each shard group, its members included, by its GroupSlot's mutex (shard_group.h,
// ABSL_GUARDED_BY: checked by clang). The hot path (bundles of plans and heartbeats,
// collective progress included, that carry no CommAbort acknowledgement) only touches one
// group (the progress goes to the communicator table under its own leaf mutex): it holds
// `mu_` shared (CoreReaderLock) plus that group's mutex, so that different groups, of one job
// or of several, are served in parallel. A holder of `mu_` exclusive takes a group's mutex as
// it goes (HeldGroup), which never waits (they are only taken under `mu_` shared). The functions
// annotated ABSL_SHARED_LOCKS_REQUIRED(mu_) take a group the caller holds either way.
// What may block or call back runs after the lock is released: log lines and the
// completions of waiting communicator calls are queued under it (CoreMutex::Defer) and
// carried out on the way out (core_mutex.h). RankSink::Send (and SendDecisions) is the exception, on purpose: it
// is called with the lock held, so that messages to one rank leave in the order the core
// produced them; that is why a sink must only queue (never block, never call back). The
// network writes start after unlocking (CoreMutex::Kick, RankSink::Kick).
#ifndef SHARDCOORD_COORDINATOR_CORE_COORDINATOR_CORE_H_
#define SHARDCOORD_COORDINATOR_CORE_COORDINATOR_CORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/buffer_budget.h"
#include "coordinator/core/clock.h"
#include "coordinator/core/comm_table.h"
#include "coordinator/core/core_mutex.h"
#include "coordinator/engine/decision_engine.h"
#include "coordinator/core/invariant.h"
#include "coordinator/core/job_table.h"
#include "coordinator/core/rank_sink.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/core/run_pins.h"
#include "coordinator/core/shard_group.h"
#include "coordinator/core/worker_report.h"
#include "coordinator/journal/event_journal.h"
#include "coordinator/journal/event_kind.h"
#include "coordinator/settings/options.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

class DaemonMetrics;

class CoordinatorCore {
 public:
  CoordinatorCore(CoordinatorOptions options, std::shared_ptr<const Clock> clock);
  ~CoordinatorCore();

  CoordinatorCore(const CoordinatorCore&) = delete;
  CoordinatorCore& operator=(const CoordinatorCore&) = delete;

  const CoordinatorOptions& options() const { return options_; }
  // This process's incarnation (DESIGN 12): options().incarnation, or 1 when unset.
  uint64_t incarnation() const { return incarnation_; }
  // Digest of the settings that change decisions; a resuming rank must have registered
  // under the same (RegisterResponse.config_digest).
  uint64_t config_digest() const { return config_digest_; }
  // The daemon-wide budget of memory held for clients (max_buffered_bytes): sinks charge
  // their queues to it, the core the resumes it holds.
  const std::shared_ptr<BufferBudget>& buffers() const { return buffers_; }
  // Counters and histograms fed as things happen (daemon_metrics.h), for /metrics.
  const DaemonMetrics& metrics() const { return *metrics_; }
  // The address actually bound (port 0 resolved), for status.
  void SetBoundAddress(const std::string& address) {
    CoreLock lock(&mu_);
    bound_address_ = address;
  }

  // Registers the rank behind `session_id` (its RegisterRequest, converted by the transport:
  // server/wire_intake.h; checked here first). On success the RegisterResponse has already
  // been sent through `sink` (so it precedes any decision). On failure the rank is not
  // admitted and nothing of its job changed (but admitting it may already have forgotten
  // ended jobs, or reset an ended one for a rerun: job_evicted, job_replaced, job_rerun
  // events), and the status says what was wrong: FAILED_PRECONDITION first for a worker of
  // another wire revision (naming both), then INVALID_ARGUMENT (malformed request, rank outside the
  // world, root without an outer root, ...), RESOURCE_EXHAUSTED (over a max_* setting, named),
  // FAILED_PRECONDITION (world size, group size, manifest, policy, fallback or
  // wrap_outer_model differ from what the job / group already has; a resume this process
  // cannot accept), ALREADY_EXISTS (the rank is live in another session), UNAVAILABLE
  // (shutting down).
  absl::Status Register(uint64_t session_id, const Registration& request,
                        std::shared_ptr<RankSink> sink);

  // Everything a worker had queued since its last message (WorkerMessage.bundle, converted by
  // the transport: server/wire_intake.h), handled in this order: its heartbeat (liveness, memory, and the collective progress of its open
  // communicators), its acknowledgements of CommAbort (it aborted its communicator for that
  // epoch), its plans. Bad plans are answered with PlanRejected on the session; decisions that
  // became ready are sent to every member of the group.
  void OnBundle(uint64_t session_id, const WorkerReport& report);
  // A clean leave: the rank becomes LEFT. `failed` (the trainer stopped on an error): the rank
  // becomes DEAD with reason "failed: REASON" and its group fails naming it.
  void OnGoodbye(uint64_t session_id, const std::string& reason, bool failed = false);
  // The session's stream ended without a goodbye: a registered rank is declared dead.
  // Idempotent; unknown sessions are ignored.
  void OnSessionClosed(uint64_t session_id, const std::string& why);

  // Declares dead every live rank silent for longer than the heartbeat timeout and fails
  // microbatches pending for longer than the plan timeout. Called periodically.
  // `started`: when the ticker decided to tick (real time; InfinitePast: no check). If the
  // core's clock is past it by more than half the heartbeat timeout once the lock is taken,
  // the daemon was stopped in between (the ticker's own gap check came before the pause):
  // deadlines restart as after OnPaused instead of declaring every silent rank dead.
  void Tick(absl::Time started = absl::InfinitePast());

  // The daemon itself did not run for `gap` (SIGSTOP, VM pause, starvation, clock jump):
  // heartbeats sat in socket buffers meanwhile, so every live rank's heartbeat deadline
  // restarts now instead of every rank being declared dead at once. Called by the tick loop.
  void OnPaused(absl::Duration gap);

  // Sends a shutdown notice to every live session and closes it with UNAVAILABLE.
  void Shutdown();

  // Records the daemon starting to serve, or stopping, in the journal ("daemon_started",
  // "daemon_stopped"), with its version and incarnation and `detail`.
  void RecordDaemonEvent(bool started, const std::string& detail);

  // --- Communicators (DESIGN 4). Callers must be live ranks of the job and members of
  // the communicator. Waiting calls complete through `done` exactly once, possibly later
  // and from another thread, always after the core's mutex was released (so `done` may
  // call back into the core). Errors: NOT_FOUND (no such job), FAILED_PRECONDITION (rank not live,
  // not a member, wrong epoch, ranks differ from the communicator's), ALREADY_EXISTS (a key
  // published twice), ABORTED (the epoch was aborted: the message says why),
  // DEADLINE_EXCEEDED (members or keys still missing at the deadline, named).
  using JoinDone = CommTable::JoinDone;
  using GetDone = CommTable::GetDone;
  // Joins the communicator's current epoch; starts a new epoch when the last one was
  // aborted (or none exists) once every member is live, waiting up to the timeout.
  void CommJoin(const CommJoinCall& call, JoinDone done);
  absl::Status StoreSet(StoreSetCall call);
  // Answers once every key is set in the epoch's store.
  void StoreGet(StoreGetCall call, GetDone done);
  absl::Status CommReport(const CommReportCall& call);
  v1::ListCommsResponse Comms(const std::string& job_id) const;

  // Queries for operators. job_id "" means every job.
  v1::StatusResponse Status(const std::string& job_id) const;
  v1::ListRanksResponse Ranks(const std::string& job_id) const;
  v1::ListGroupsResponse Groups(const std::string& job_id) const;
  v1::ListDecisionsResponse Decisions(const std::string& job_id, int group, int limit) const;
  std::vector<v1::Event> Events(const std::string& job_id, uint64_t after_id, int limit) const {
    return journal_.List(EventFilter{job_id, "", 0, after_id, limit});
  }
  std::vector<v1::Event> Events(const EventFilter& filter) const { return journal_.List(filter); }
  // Keeps the journal in options().journal_file as well (no-op when unset); the error names
  // the file. Call before serving.
  absl::Status OpenJournal() {
    if (options_.journal_file.empty()) return absl::OkStatus();
    return journal_.Persist(options_.journal_file, options_.journal_retention, options_.journal_max_events);
  }
  // Waits until the journal's events are in its file (tests; shutdown).
  void FlushJournal() { journal_.Flush(); }

 private:
  // Group access. A group's state is guarded by its slot's mutex (GroupSlot), which the hot
  // path takes with mu_ held shared (GroupLock). A holder of mu_ exclusive takes it too, for
  // the scope of a HeldGroup: no other thread holds a group mutex meanwhile (they are only taken
  // under mu_ shared), so the take never waits, and the exclusive paths may nest (a removal
  // inside a scan of the same group: GroupMutex::LockNested). The lock analysis so checks every
  // access to a group, from either kind of path, with no exception.
  class ABSL_SCOPED_LOCKABLE HeldGroup {
   public:
    // With mu_ held exclusively only. A take that had to wait is an invariant failure.
    HeldGroup(const Job& job, const GroupSlot& slot) ABSL_EXCLUSIVE_LOCK_FUNCTION(slot.mu);
    ~HeldGroup() ABSL_UNLOCK_FUNCTION() { slot_.mu.UnlockNested(); }
    HeldGroup(const HeldGroup&) = delete;
    HeldGroup& operator=(const HeldGroup&) = delete;

   private:
    const GroupSlot& slot_;
  };
  static GroupSlot& SlotOf(const Job& job, int rank) { return *job.groups[job.GroupOf(rank)]; }
  // Calls f(group, member, its session binding) for every rank of the job, in rank order, each
  // group held meanwhile.
  template <typename F>
  void ForEachMember(const Job& job, F f) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& slot : job.groups) {
      HeldGroup held(job, *slot);
      for (int i = 0; i < slot->group.size(); ++i) f(slot->group.members()[i], slot->group.binding_at(i));
    }
  }
  // The member of `group` behind `session_id` if that is the rank's current live session.
  static const Member* LiveIn(ShardGroup& group, int rank, uint64_t session_id);

  // Carries out what one of `group`'s operations asked (GroupEffects), under the group's
  // lock: its messages, in order, to its live members' sinks, then its events and counters.
  void Apply(Job& job, ShardGroup& group, GroupEffects& fx) ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The parts of a bundle, in the order OnBundle takes them: heartbeat and plans with the
  // group's mutex held too, or mu_ exclusively; CommAbort acknowledgements under mu_ exclusive.
  void TakeHeartbeat(Job& job, ShardGroup& group, const Member& m, const HeartbeatReport& heartbeat)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void TakePlans(Job& job, ShardGroup& group, const Member& m, const PlanBatchReport& batch) ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void TakeCommAborted(Job& job, const Member& m, const CommAbortAck& ack) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns the session's member if it is the rank's current live session.
  const Member* LiveMember(uint64_t session_id, Job** job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // How a rank stops: a clean leave, its trainer's failure (said in its goodbye), or declared dead.
  enum class Leaving { kClean, kFailed, kDead };
  // Marks the rank left (or dead) and fails / cancels what its group was waiting for.
  void RemoveMember(Job& job, const Member& member, Leaving how, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the decisions batched in the bindings' `outgoing` (every member's, or one's).
  void Flush(ShardGroup& group) ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void SendBatched(SessionBinding& to) ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // To a live member with a session: what is batched for it first, then `msg`.
  void SendTo(const Member& member, SessionBinding& to, const v1::CoordinatorMessage& msg)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Sends through the session's sink; a refused send sets SessionBinding::cut_reason.
  void SinkSend(SessionBinding& to, v1::CoordinatorMessage msg) ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // What the sink answered a send: refused sets `to.cut_reason`; queued, its write starts once
  // mu_ is released.
  void OnQueued(SessionBinding& to, const absl::Status& queued) ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Register's steps (DESIGN 3, "Registration"; DESIGN 8 for the group it joins).
  // The checks that need no state, first: a malformed request changes nothing.
  absl::Status CheckRequestAlone(const Registration& req) const;
  Job* ReuseOrForgetEndedJob(const Registration& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job the rank joins (nullptr: a new one, admitted), or why it may not. (The checks that
  // need no state are in registration.h.)
  // `proven`: the registration a verified resume proved (nullptr for any other request).
  absl::StatusOr<Job*> FindOrAdmitJob(const Registration& req, const RegistrationClaim* proven)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PERMISSION_DENIED for a resume no key can check, past the recovery window after a start.
  absl::Status CheckUnverifiedResumeIsTimely(const Registration& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PERMISSION_DENIED for a resume of another run than the job's current one: the run of the
  // job this process holds, else the run the runs file pinned (with a state file; run_pins.h).
  absl::Status CheckResumedRun(const Registration& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A resume refused for its trust (credential, seals, run): the refusal is evented (so logged
  // and counted, shardcoord_events_total{kind="resume_refused"}) and returned.
  absl::Status RefuseResume(const Registration& req, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The run a new job takes: the resume's, else the one pinned before a restart, else a new one.
  std::string RunOfNewJob(const Registration& req, bool resuming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the runs of the jobs with a live rank (and the pins not yet claimed, within the
  // recovery window, and `joining`, whose first rank is being accepted) to the runs file when
  // they changed (run_pins.h).
  void SyncRunPins(const Job* joining = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An accepted rank becomes live in its group (not recovering): its RegisterResponse, the
  // group's state, its communicators, and a notice to the others if the group re-formed.
  void JoinGroup(Job& job, ShardGroup& group, const Member& m, uint64_t session_id, std::shared_ptr<RankSink> sink,
                 const Registration& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The RegisterResponse for an accepted rank (session key, resume credential), with its events.
  v1::CoordinatorMessage Welcome(const Job& job, const ShardGroup& group, const Member& m,
                                 const Registration& req, bool rejoin) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sizes, the group's reference, and the rank's slot: a live slot is taken only by a verified
  // resume of a newer registration than its holder's (`proven`, RegistrationClaim); a resume of
  // an older one than the slot's last holder proved is refused.
  absl::Status CheckJobAccepts(const Job& job, const Registration& req, const RegistrationClaim* proven) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live holder of `m`'s slot gives it up to a verified resume of a newer registration:
  // its session ends (PERMISSION_DENIED saying why), evented; outside recovery it is lost to
  // its group as a death is.
  void Supersede(Job& job, ShardGroup& group, const Member& m, const Registration& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The accepted rank takes its slot: its group recovering (ResumeMember) or not (JoinGroup),
  // superseding a holder `proven` outdates; `proven`: what a verified resume proved, else null
  // (an unverified resume is evented as such).
  void Seat(Job& job, const Registration& req, uint64_t session_id, std::shared_ptr<RankSink> sink,
            BufferCharge resume_charge, bool resuming, const RegistrationClaim* proven)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Job& CreateJob(const Registration& req, const std::string& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetLive(Job& job, const Member& m, uint64_t session_id, std::shared_ptr<RankSink> sink,
               const Registration& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The status query's part, under mu_ shared: takes each group's mutex itself.
  void FillJobStatus(const Job& job, v1::JobStatus* out) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Communicators (coordinator_core_comms.cc): the job's CommTable, through a CommHost that
  // answers for the job's members. Exclusive holders of mu_ only.
  class JobHost;
  // The job of a communicator call, checked: the caller's rank is live and the call comes from
  // its session (PERMISSION_DENIED otherwise).
  absl::StatusOr<Job*> CommCaller(const CommCallerId& caller) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank became unreachable (`clean`: it left) or live again: its communicators react.
  void OnMemberLost(Job& job, int rank, bool clean, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnMemberBack(Job& job, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TickComms(Job& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResumeComms(Job& job, int rank, const v1::ResumeState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailAllCommWaiters(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // RemoveMember's steps: the job ends when no rank is live; the group reacts to a clean
  // leave (ShardGroup::OnLeft) or a death (FailGroup) (DESIGN 3, "Failures").
  void MaybeEndJob(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnPaused's work, under the lock.
  void RestartHeartbeatDeadlines(absl::Duration gap) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Member `idx` of `group` died (`full` says why): the group fails, the job hears of it.
  void FailGroup(Job& job, ShardGroup& group, int idx, const std::string& full) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the live ranks of the job's other groups that `rank` of `group` was declared dead.
  void NotifyRankLost(Job& job, const ShardGroup& group, int rank, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Recovery after a restart (coordinator_core_recovery.cc, DESIGN 12; the group's part in
  // shard_group_states.cc).
  // A rank (resuming, or registering for the first time) joins a recovering group.
  void ResumeMember(Job& job, ShardGroup& group, const Member& m, uint64_t session_id, std::shared_ptr<RankSink> sink,
                    const Registration& req, BufferCharge charge) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the memory a resume will be held in from buffers_, or says which bound refuses it.
  absl::StatusOr<BufferCharge> ChargeResume(const Registration& req);
  // Fails the missing members of groups whose recovery window passed.
  void ExpireRecovery(Job& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A job with a group that has not formed form_timeout after its start: its live ranks are
  // declared dead, naming the ranks that never came, and it ends (its rank slots can go).
  void ExpireForming(Job& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Cuts ranks that do not read (their write waited more than kNotReadingGrace), the biggest
  // holders first, while the daemon's buffers are over max_buffered_bytes; and any that has not
  // read for a heartbeat timeout. A rank that reads is never cut for the budget (RankSink).
  void ReclaimBuffers(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr absl::Duration kNotReadingGrace = absl::Seconds(1);
  // The sink's backlog, its write's wait counted from the end of the daemon's last pause at most.
  RankSink::Backlog BacklogOf(const RankSink& sink) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Records an event in the journal; its log line is written after the mutex is released.
  void Event(Severity severity, EventKind kind, const std::string& job,
             int rank, int group, const std::string& message) ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  const std::shared_ptr<const Clock> clock_;
  const absl::Time started_;
  const uint64_t incarnation_;
  const uint64_t config_digest_;
  // Credentials for resumes and seals on decisions (resume_auth.h). Immutable: no lock.
  const ResumeAuthority resume_auth_;
  EventJournal journal_;
  const std::unique_ptr<DaemonMetrics> metrics_;  // Thread-safe by itself.
  // Before jobs_: their members' charges give back to it as they are destroyed.
  const std::shared_ptr<BufferBudget> buffers_;

  mutable CoreMutex mu_;
  JobTable jobs_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // With a state file: the runs file (run_pins.h), the runs it held at this start that no
  // resume claimed yet, and what was last written.
  const std::string runs_file_;
  RunPins pinned_runs_ ABSL_GUARDED_BY(mu_);
  RunPins written_runs_ ABSL_GUARDED_BY(mu_);
  absl::Time retry_runs_write_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // The end of the last pause of the daemon (Tick): a write cannot have waited for its rank
  // while the daemon itself was stopped.
  absl::Time last_pause_end_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // The serial of the last registration answered (RegisterResponse.registration).
  uint64_t last_registration_ ABSL_GUARDED_BY(mu_) = 0;
  std::string bound_address_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_COORDINATOR_CORE_H_
