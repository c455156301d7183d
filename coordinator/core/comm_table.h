// CommTable: one job's communicators (DESIGN 4). The coordinator is the rendezvous of every
// (job, communicator, epoch) and the authority on its health: it aborts an epoch for every
// member when one member is lost, and starts the next epoch once every member is live again.
//
// Not thread-safe: the core calls it with its lock held exclusively, but for the collective
// progress that heartbeats carry (recorded under the table's own mutex: see RecordProgress)
// and the status views (Fill, Alerts), which only read, under the lock shared. What it needs
// of the rest of the core (whether a rank is live, sending to a rank, events, completions
// after unlocking) it asks of a CommHost. Liveness reaches it as two signals, OnRankLost and
// OnRankBack; it reacts on its own.
#ifndef SHARDCOORD_COORDINATOR_CORE_COMM_TABLE_H_
#define SHARDCOORD_COORDINATOR_CORE_COMM_TABLE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/core/buffer_budget.h"
#include "coordinator/core/comm_call.h"
#include "coordinator/core/core_mutex.h"
#include "coordinator/core/worker_report.h"
#include "coordinator/journal/event_kind.h"
#include "coordinator/settings/options.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

// Where one member stands in a communicator's current epoch (shown by `shardctl comms` by
// CommMemberStateName).
enum class CommMemberState { kAbsent, kJoined, kReady, kAborted, kDead, kLeft };

constexpr const char* CommMemberStateName(CommMemberState s) {
  switch (s) {
    case CommMemberState::kAbsent: return "absent";
    case CommMemberState::kJoined: return "joined";
    case CommMemberState::kReady: return "ready";
    case CommMemberState::kAborted: return "aborted";
    case CommMemberState::kDead: return "dead";
    case CommMemberState::kLeft: return "left";
  }
  return "unknown";
}

// What a job's communicators need from the rest of the core.
class CommHost {
 public:
  virtual ~CommHost() = default;
  virtual absl::Time Now() const = 0;
  virtual v1::RankState StateOf(int rank) const = 0;
  virtual std::string DeadReasonOf(int rank) const = 0;
  // Queues `msg` for the rank (a live one; others are skipped).
  virtual void Send(int rank, const v1::CoordinatorMessage& msg) = 0;
  // An event of the job (rank -1: none in particular).
  virtual void Event(Severity severity, EventKind kind, int rank, const std::string& message) = 0;
  // Runs `f` once the core's lock is released (completions of waiting calls).
  virtual void Defer(std::function<void()> f) = 0;
};

class CommTable {
 public:
  using JoinDone = std::function<void(absl::StatusOr<CommMembership>)>;
  // The values, in the order of the call's keys.
  using GetDone = std::function<void(absl::StatusOr<std::vector<std::string>>)>;

  // For job `job_id` of `world_size` ranks in groups of `group_size`. Store entries are charged
  // to `buffers` (the daemon's max_buffered_bytes; none when null) until their epoch ends.
  CommTable(std::string job_id, int world_size, int group_size, const CoordinatorLimits& limits,
            absl::Duration behind_threshold, BufferBudget* buffers = nullptr);

  // Every mutator below takes `held`, the lock its caller holds exclusively over the table (the
  // core's, CoordinatorCore::mu_): the compiler checks each call for it (LevelDB's LogAndApply
  // style). `host` answers for the job's members under that same lock.
  //
  // The RPCs, for `rank`, which the caller checked is live and the caller's session (DESIGN 13).
  // Errors as CoordinatorCore's CommJoin etc. say; waiting calls complete through `done`
  // exactly once, through CommHost::Defer.
  void Join(CommHost& host, const CoreMutex& held, const CommJoinCall& call, JoinDone done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);
  // By value: the store keeps the call's value, a waiter its keys.
  absl::Status Set(CommHost& host, const CoreMutex& held, StoreSetCall call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);
  void Get(CommHost& host, const CoreMutex& held, StoreGetCall call, GetDone done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);
  absl::Status Report(CommHost& host, const CoreMutex& held, const CommReportCall& call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);
  // The rank acknowledged the abort of an epoch (on its session stream).
  void AckAbort(CommHost& host, const CoreMutex& held, const CommAbortAck& ack, int rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);

  // Liveness: a rank died (`clean` false: every live epoch it belongs to is aborted) or left
  // (nobody is aborted; an epoch whose members are all gone is closed); a rank is live again.
  void OnRankLost(CommHost& host, const CoreMutex& held, int rank, bool clean, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);
  void OnRankBack(CommHost& host, const CoreMutex& held, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);

  // The collective progress of the rank's open communicators, from its heartbeat. Takes the
  // table's own mutex: a heartbeat records it holding the core's lock shared only.
  void RecordProgress(int rank, const std::vector<CommProgressReport>& progress, absl::Time now)
      ABSL_LOCKS_EXCLUDED(progress_mu_);
  // The tick: waiters past their deadline fail; members that keep others waiting in a
  // collective are named (CommStatus.behind).
  void Tick(CommHost& host, const CoreMutex& held, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);
  // Every waiting call fails with `why` (shutdown).
  void FailAllWaiters(CommHost& host, const CoreMutex& held, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);

  // After a coordinator restart: the epochs `rank` held when it resumed (DESIGN 12).
  void Resume(CommHost& host, const CoreMutex& held, int rank, const v1::ResumeState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(held);

  // For the status queries.
  void Fill(v1::ListCommsResponse* out) const ABSL_LOCKS_EXCLUDED(progress_mu_);
  // One line per communicator that is behind, or aborted by a death (`left` says whether a
  // rank left rather than died).
  std::vector<std::string> Alerts(const std::function<bool(int rank)>& left) const;

 private:
  struct Progress {
    int64_t issued = 0;
    int64_t completed = 0;
    absl::Time waiting_since = absl::InfinitePast();  // Since when blocked in `completed + 1`.
  };
  struct JoinWaiter {
    int rank;
    absl::Time deadline;
    JoinDone done;
  };
  struct GetWaiter {
    int64_t epoch;
    std::vector<std::string> keys;
    absl::Time deadline;
    GetDone done;
  };
  struct Comm {
    std::string name;
    std::vector<int> ranks;  // Ascending.
    int64_t epoch = 0;       // 0: no epoch yet; the first is 1.
    v1::CommState state = v1::COMM_STATE_UNSPECIFIED;
    std::map<int, CommMemberState> member_state;
    std::string behind;                        // See CommStatus.behind.
    std::map<std::string, std::string> store;  // The current epoch's keys.
    BufferCharge store_charge;                 // What they hold, from the daemon's budget.
    std::string abort_reason;
    bool ended_cleanly = false;  // The current epoch ends (or ended) by a clean leave.
    std::vector<int> lost_ranks;
    int64_t epochs_aborted = 0;
    std::vector<JoinWaiter> join_waiters;
    std::vector<GetWaiter> get_waiters;
    // After a restart: the epoch each member resumed with, until every member is back.
    std::map<int, int64_t> resumed_epochs;
    bool recovering = false;
  };

  // The members of communicator `name`: the world, a shard group, or a custom list (the
  // caller's `ranks`, else those of the communicator already created). Checks the list.
  absl::StatusOr<std::vector<int>> Members(const std::string& name, const std::vector<int>& ranks) const;
  // The store's values of `keys`, in their order; every key is set.
  static std::vector<std::string> Values(const Comm& comm, const std::vector<std::string>& keys);
  // Resolves the communicator (creating it on first use) for member `rank`.
  absl::StatusOr<Comm*> Resolve(int rank, const std::string& name, const std::vector<int>& ranks);
  absl::Status CheckEpoch(const Comm& comm, int64_t epoch) const;
  // Starts a new epoch if the last one was aborted (or none exists) and every member is
  // live; then completes the join waiters.
  // An epoch ended (closed, aborted) or a new one starts: its store is of no more use.
  static void ForgetStore(Comm& comm);
  void MaybeStartEpoch(CommHost& host, Comm& comm);
  // Ends the current epoch for every member. `failure` false is a clean end (a member that
  // left registered again): same effect, but not counted as an abort and logged as info.
  void Abort(CommHost& host, Comm& comm, const std::string& reason, const std::vector<int>& lost,
             bool failure = true);
  // ABORTING -> ABORTED once every live member acknowledged; then a new epoch may start.
  void MaybeFinishAbort(CommHost& host, Comm& comm);
  void MaybeFinishRecovery(CommHost& host, Comm& comm);
  void ExpireWaiters(CommHost& host, Comm& comm, absl::Time now);
  void DetectBehind(CommHost& host, Comm& comm, absl::Time now) ABSL_LOCKS_EXCLUDED(progress_mu_);
  // Why `missing` (ranks of a communicator, none live) keep an epoch from starting: the
  // dead first, with the first one's reason, then those that left or never registered.
  static std::string MissingRanks(const CommHost& host, const std::vector<int>& missing);
  // Clears the progress of a new epoch.
  void ClearProgress(const std::string& name) ABSL_LOCKS_EXCLUDED(progress_mu_);

  const std::string job_id_;
  const int world_size_;
  const int group_size_;
  const CoordinatorLimits limits_;
  BufferBudget* const buffers_;
  const absl::Duration behind_threshold_;
  std::map<std::string, Comm> comms_;
  // Collective progress, by communicator and rank, for the current epochs: written by
  // heartbeats under the core's lock held shared, hence a lock of its own (a leaf).
  mutable absl::Mutex progress_mu_;
  std::map<std::string, std::pair<int64_t, std::map<int, Progress>>> progress_ ABSL_GUARDED_BY(progress_mu_);
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_COMM_TABLE_H_
