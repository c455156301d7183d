// Worker::Impl, shared by the files that implement it (DESIGN 9, "Threads and locks"):
//   worker.cc          the public API, registration (Start), plans and decisions, Close,
//                      communicators;
//   worker_session.cc  the session stream: the reader (decisions, failures, aborts, notices)
//                      and the writer (plans, heartbeats, goodbye).
// One mutex, mu_, guards the state; decisions wait in a DecisionQueue (decision_queue.h).
#ifndef SHARDCOORD_WORKER_SRC_WORKER_IMPL_H_
#define SHARDCOORD_WORKER_SRC_WORKER_IMPL_H_

#include "shardcoord/worker.h"

#include "comm_registry.h"
#include "coordinator_rendezvous.h"
#include "decision_queue.h"
#include "shardcoord/plan_check.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace shardcoord {
namespace internal {

// Keepalive pings notice a coordinator that vanished without closing the connection.
inline constexpr int kKeepaliveTimeMs = 5000;
inline constexpr int kKeepaliveTimeoutMs = 5000;
// A decision message lists every module; the coordinator splits batches at 1 MiB, and one
// decision of a manifest at the coordinator's caps stays below this.
inline constexpr int kWorkerMaxReceiveBytes = 64 << 20;
// A resume's registration stays below the coordinator's receive limit (gRPC's 4 MiB).
inline constexpr size_t kResumeMaxBytes = 3 << 20;

// The group's ranks for a message or a log line: all of a small group, the ends of a big one.
std::string RanksOf(const std::vector<int>& ranks);

}  // namespace internal

class Worker::Impl {
 public:
  explicit Impl(WorkerOptions options) : options_(std::move(options)) {
    log_ = logging::Get("worker");
    for (const auto& m : options_.modules) {
      module_names_.insert(m.name);
      module_list_.push_back(m.name);  // Registration order, for messages.
    }
  }

  ~Impl() { Close(kDefaultCloseTimeout); }

  absl::Status Start();
  // Start's steps: the channel and the session stream; the registration; its answer.
  absl::Status Connect(absl::Time deadline);
  // One attempt: connect, register, wait for the answer (Start retries UNAVAILABLE).
  absl::Status RegisterOnce(absl::Time deadline);
  v1::WorkerMessage RegisterMessage() const;
  absl::Status AwaitRegistered(absl::Time deadline);
  absl::Status ReportPlan(const MicrobatchPlan& plan);
  absl::StatusOr<MicrobatchDecision> GetDecision(const MicrobatchKey& key, absl::Duration timeout);
  int UndecidedPlans() const {
    absl::MutexLock lock(&mu_);
    return queue_.undecided();
  }
  void ReportMemory(const std::vector<ModuleMemoryUsage>& usage) {
    absl::MutexLock lock(&mu_);
    memory_ = usage;
    memory_dirty_ = true;
  }
  // A cost report waits to be sent and its interval has passed.
  bool CostsDue() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return costs_dirty_ && absl::Now() >= costs_sent_ + kCostReportInterval;
  }
  // The last cost report goes out again with the next heartbeat.
  void ResendCosts() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    costs_dirty_ = !costs_.empty() || frozen_budget_bytes_ > 0;
    costs_sent_ = absl::InfinitePast();
  }
  void ReportCosts(const std::vector<ModuleCost>& costs, int64_t frozen_budget_bytes) {
    absl::MutexLock lock(&mu_);
    costs_ = costs;
    frozen_budget_bytes_ = frozen_budget_bytes;
    costs_dirty_ = true;
  }
  absl::Status Health() const {
    absl::MutexLock lock(&mu_);
    if (!session_status_.ok()) return session_status_;
    if (!group_failure_.empty()) return absl::AbortedError(group_failure_);
    return queue_.late_failure();
  }
  absl::Status JobHealth() const {
    absl::Status own = Health();
    if (!own.ok()) return own;
    absl::MutexLock lock(&mu_);
    if (!job_failure_.empty()) return absl::AbortedError(job_failure_);
    return absl::OkStatus();
  }
  GroupInfo group() const {
    absl::MutexLock lock(&mu_);
    return group_;
  }
  absl::Status AwaitGroupReady(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return group_failure_.empty() || !session_status_.ok();
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (!session_status_.ok()) return session_status_;
    if (!group_failure_.empty()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "group ", group_.group, " did not re-form within ", absl::ToInt64Milliseconds(timeout),
          " ms: ", group_failure_));
    }
    return absl::OkStatus();
  }
  void Close(absl::Duration timeout, const std::string& reason = "worker closed", bool failed = false);
  absl::StatusOr<std::shared_ptr<Communicator>> OpenCommunicator(const CommunicatorOptions& options);

 private:
  // The reader thread: reads each session's stream; when one is lost, resumes (Resume)
  // or ends the session (EndSession).
  void ReaderLoop();
  void ReadStream();
  // Stops the writer and finishes the stream; returns the stream's status.
  grpc::Status FinishStream();
  // Whether a lost session may be resumed: registered, not closing, reconnect enabled, and
  // the stream ended because the coordinator went away (not because it refused us).
  bool CanResume(const grpc::Status& st) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reconnects and resumes within the reconnect window (DESIGN 12); the error says why not.
  absl::Status Resume();
  absl::Status TryResume(absl::Time window_end);
  v1::ResumeState ResumeStateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // Also sets resumed_through_.
  void StartWriterLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The session is over for good: pending calls fail with `why`, communicators abort.
  void EndSession(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriterLoop();
  // The heartbeat's content: collective progress of the open communicators, module memory.
  void FillHeartbeat(v1::Heartbeat* hb) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves every queued plan into `batch`, stamped with the group epoch.
  void TakeOutbox(v1::PlanBatch* batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Work Handle leaves for after mu_ is released: aborts to carry out, (communicator,
  // reason), then the acknowledgements (name, epoch) to send.
  struct PendingAborts {
    std::vector<std::pair<std::shared_ptr<internal::AbortableCommunicator>, std::string>> aborts;
    std::vector<std::pair<std::string, int64_t>> acks;
  };
  // Why a decision from the coordinator cannot be carried out here ("" when it can): a
  // module list other than the manifest's, or a decision value this worker does not know.
  std::string UnusableDecision(const v1::MicrobatchDecision& d) const;
  void Handle(const v1::CoordinatorMessage& msg, PendingAborts* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnRegistered(const v1::RegisterResponse& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The answer to a resume: checks it, then the session goes on with the new process.
  absl::Status OnResumed(const v1::RegisterResponse& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A decision, rejection or failure that names no microbatch: everything pending fails.
  void FailKeyless(const std::string& what, const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands each decision to the queue, or fails what it cannot be used for.
  void OnDecisions(const v1::DecisionBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnPlanRejected(const v1::PlanRejected& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnNotice(const v1::Notice& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Prefix() const {
    return absl::StrCat("job=", options_.job_id, " rank=", options_.rank);
  }

  const WorkerOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  std::set<std::string> module_names_;
  std::vector<std::string> module_list_;
  std::string address_;
  std::string token_;  // Resolved at Start (ResolveToken); never logged.
  TlsFiles tls_;       // Resolved at Start (ResolveTls); the files are read at each Connect.

  // The current session's channel, stub and stream: replaced by the reader thread when it
  // resumes (under mu_, while the writer is stopped). The stub is shared with
  // communicators, which may outlive us; the stream is used by the reader and writer only.
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Coordinator::Stub> stub_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::ClientContext> ctx_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream_;
  std::thread reader_;
  std::thread writer_;

  mutable absl::Mutex mu_;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  GroupInfo group_ ABSL_GUARDED_BY(mu_);
  absl::Status session_status_ ABSL_GUARDED_BY(mu_);  // Non-OK once the stream is gone.
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;   // The reader saw the stream end.
  bool reader_done_ ABSL_GUARDED_BY(mu_) = false;  // ... and recorded why.
  bool writer_started_ ABSL_GUARDED_BY(mu_) = false;
  std::string group_failure_ ABSL_GUARDED_BY(mu_);     // Non-empty while the group is failed.
  std::string job_failure_ ABSL_GUARDED_BY(mu_);       // Non-empty once a rank of another group died.
  internal::DecisionQueue queue_ ABSL_GUARDED_BY(mu_);  // The lookahead window.
  internal::CommRegistry comms_;  // Thread-safe; its lock is a leaf (may be taken under mu_).
  std::deque<v1::MicrobatchPlan> outbox_ ABSL_GUARDED_BY(mu_);
  std::vector<ModuleMemoryUsage> memory_ ABSL_GUARDED_BY(mu_);
  bool memory_dirty_ ABSL_GUARDED_BY(mu_) = false;  // Not sent yet: send without waiting.
  std::vector<ModuleCost> costs_ ABSL_GUARDED_BY(mu_);
  int64_t frozen_budget_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool costs_dirty_ ABSL_GUARDED_BY(mu_) = false;  // Not sent yet: goes with a heartbeat.
  absl::Time costs_sent_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // GetDecision calls that waited for their decision, and how long in all (heartbeats carry them).
  int64_t decision_stalls_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration decision_stall_time_ ABSL_GUARDED_BY(mu_);
  // CommAbort acknowledgements for the writer, queued once the aborts ran.
  std::vector<std::pair<std::string, int64_t>> ready_acks_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::string close_reason_ ABSL_GUARDED_BY(mu_);  // The goodbye's reason.
  bool close_failed_ ABSL_GUARDED_BY(mu_) = false;  // The goodbye says the trainer failed (Fail).
  bool writer_done_ ABSL_GUARDED_BY(mu_) = false;
  // Resume (DESIGN 12): the coordinator process we are registered with and what it answered.
  uint64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string coordinator_version_ ABSL_GUARDED_BY(mu_);  // RegisterResponse.coordinator_version.
  // Shared with communicators' rendezvous (they may outlive us); set at each registration.
  const std::shared_ptr<internal::SessionKey> session_key_ = std::make_shared<internal::SessionKey>();
  v1::RegisterResponse previous_ ABSL_GUARDED_BY(mu_);
  bool resume_answered_ ABSL_GUARDED_BY(mu_) = false;  // This attempt's first read returned.
  std::optional<MicrobatchKey> resumed_through_ ABSL_GUARDED_BY(mu_);  // Last plan the resume carried.
  bool closed_ = false;  // Touched only by Close, which callers serialize via close_mu_.
  absl::Mutex close_mu_;
};

}  // namespace shardcoord

#endif  // SHARDCOORD_WORKER_SRC_WORKER_IMPL_H_
