// Internal to the worker library: what every collective backend shares (DESIGN 4).
//
// A backend (gloo_communicator.cc, nccl_communicator.cc) derives from CommunicatorBase,
// which keeps the epoch's abort reason, health and collective progress, and the rule for a
// failure seen here: report it to the coordinator, then abort with the coordinator's verdict
// when it has one (it names the lost rank), else with our own error. The backend adds how
// to connect, how to run a collective and how to stop its transport on an abort.
//
// Locking: mu_ (protected) guards the abort reason and whatever the backend guards with it;
// it is a leaf lock: nothing that blocks or calls out runs under it, except what a backend
// documents (NCCL's ncclCommAbort).
#ifndef SHARDCOORD_WORKER_SRC_COMM_BASE_H_
#define SHARDCOORD_WORKER_SRC_COMM_BASE_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "rendezvous.h"
#include "shardcoord/communicator.h"

namespace shardcoord::internal {

// One member's view of one communicator epoch, as the coordinator answered its join.
struct CommSpec {
  std::string job_id;  // For messages.
  int job_rank = 0;
  std::string name;
  int64_t epoch = 0;
  std::vector<int> ranks;  // Job ranks, ascending, including job_rank.
  CommunicatorOptions options;
};

// A communicator the worker can abort when the coordinator says so.
class AbortableCommunicator : public Communicator {
 public:
  using Communicator::Communicator;
  // The coordinator aborted this epoch. Called from the worker's reader thread; must not
  // block on the network. Pending and later collectives fail with ABORTED and `reason`.
  virtual void Abort(const std::string& reason) = 0;
  // The same, when this rank's worker closes on purpose: logged as information, not as a
  // warning (a clean job logs no warning).
  virtual void AbortOnClose(const std::string& reason) = 0;
  // Joins the rendezvous and connects to every member, within the join timeout.
  virtual absl::Status Connect() = 0;
  // Collectives started and finished in this epoch; sent with heartbeats so the
  // coordinator can name a member that keeps the others waiting. Thread-safe.
  virtual void Progress(int64_t* issued, int64_t* completed) const = 0;
};

class CommunicatorBase : public AbortableCommunicator {
 public:
  // Records the first reason, logs it and stops the backend (AbortBackend); later calls
  // do nothing.
  void Abort(const std::string& reason) final;
  void AbortOnClose(const std::string& reason) final;
  void Progress(int64_t* issued, int64_t* completed) const final;
  absl::Status Health() const final;

 private:
  void AbortLogged(const std::string& reason, bool expected);

 protected:
  CommunicatorBase(std::shared_ptr<EpochRendezvous> rendezvous, CommSpec spec);

  // The backend's part of an abort: make a collective in flight return and peers blocked
  // on us see the end. Called once, by the first Abort, without mu_ held.
  virtual void AbortBackend() = 0;
  // True once Connect succeeded.
  virtual bool ConnectedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;

  bool AbortedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !abort_reason_.empty(); }
  // ABORTED, naming the communicator, the epoch and the reason.
  absl::Status AbortedStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AbortedStatus() const ABSL_LOCKS_EXCLUDED(mu_);
  // OK, or why no collective may start: aborted, or not connected.
  absl::Status UsableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits up to `wait` for an abort from the coordinator; true if one came.
  bool AwaitAbort(absl::Duration wait) ABSL_LOCKS_EXCLUDED(mu_);
  // A collective failed here: reports `error`, aborts the epoch (with the coordinator's
  // reason when it already aborted it) and returns the resulting ABORTED status.
  absl::Status FailEpoch(const std::string& error) ABSL_LOCKS_EXCLUDED(mu_);

  void CountIssued() { issued_.fetch_add(1, std::memory_order_relaxed); }
  void CountCompleted() { completed_.fetch_add(1, std::memory_order_relaxed); }

  EpochRendezvous& rendezvous() const { return *rendezvous_; }
  const CommunicatorOptions& options() const { return spec_.options; }
  const CommSpec& spec() const { return spec_; }

  mutable absl::Mutex mu_;

 private:
  const std::shared_ptr<EpochRendezvous> rendezvous_;
  const CommSpec spec_;
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> completed_{0};
};

// Gloo over TCP. The device binds to $SHARDCOORD_GLOO_HOST, else this host's name.
std::shared_ptr<AbortableCommunicator> MakeGlooCommunicator(std::shared_ptr<EpochRendezvous> rendezvous,
                                                            CommSpec spec);

// NCCL, when built with SHARDCOORD_WITH_NCCL (nccl_communicator.cc).
std::shared_ptr<AbortableCommunicator> MakeNcclCommunicator(std::shared_ptr<EpochRendezvous> rendezvous,
                                                            CommSpec spec);

}  // namespace shardcoord::internal

#endif  // SHARDCOORD_WORKER_SRC_COMM_BASE_H_
