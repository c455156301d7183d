#include "shardcoord/worker.h"

#include "communicator_internal.h"
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
namespace {

// Keepalive pings notice a coordinator that vanished without closing the connection.
constexpr int kKeepaliveTimeMs = 5000;
constexpr int kKeepaliveTimeoutMs = 5000;

// A decision message lists every module; the coordinator splits batches at 1 MiB, and one
// decision of a manifest at the coordinator's caps stays below this.
constexpr int kWorkerMaxReceiveBytes = 64 << 20;

// A peer that dies mid-collective makes the next write on its socket raise SIGPIPE, whose
// default action kills the whole trainer instead of failing the collective with EPIPE
// (Gloo's TCP transport writes without MSG_NOSIGNAL). A library must not let that happen:
// ignore SIGPIPE, unless the host program installed a handler of its own.
void IgnoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
        !(current.sa_flags & SA_SIGINFO)) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

// The group's ranks for a message or a log line: all of a small group, the ends of a big one.
std::string RanksOf(const std::vector<int>& ranks) {
  if (ranks.size() <= 16) return absl::StrJoin(ranks, ",");
  return absl::StrCat(ranks.front(), "..", ranks.back(), " (", ranks.size(), " ranks)");
}

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

}  // namespace

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
  void Close(absl::Duration timeout);
  absl::StatusOr<std::shared_ptr<Communicator>> OpenCommunicator(const CommunicatorOptions& options);

 private:
  void ReaderLoop();
  void WriterLoop();
  // Work Handle leaves for after mu_ is released: aborts to carry out, (communicator,
  // reason), then the acknowledgements (name, epoch) to send.
  struct PendingAborts {
    std::vector<std::pair<std::shared_ptr<internal::AbortableCommunicator>, std::string>> aborts;
    std::vector<std::pair<std::string, int64_t>> acks;
  };
  void Handle(const v1::CoordinatorMessage& msg, PendingAborts* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnRegistered(const v1::RegisterResponse& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Coordinator::Stub> stub_;  // Shared with communicators, which may outlive us.
  grpc::ClientContext ctx_;
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
  // Open communicators by name (the latest epoch of each), for CommAbort.
  std::map<std::string, std::weak_ptr<internal::AbortableCommunicator>> comms_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::MicrobatchPlan> outbox_ ABSL_GUARDED_BY(mu_);
  std::vector<ModuleMemoryUsage> memory_ ABSL_GUARDED_BY(mu_);
  bool memory_dirty_ ABSL_GUARDED_BY(mu_) = false;  // Not sent yet: send without waiting.
  // CommAbort acknowledgements for the writer, queued once the aborts ran.
  std::vector<std::pair<std::string, int64_t>> ready_acks_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool writer_done_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ = false;  // Touched only by Close, which callers serialize via close_mu_.
  absl::Mutex close_mu_;
};

absl::Status Worker::Impl::Start() {
  address_ = options_.coordinator_address;
  if (address_.empty()) {
    if (const char* env = std::getenv(kCoordinatorAddressEnv)) address_ = env;
  }
  if (address_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no coordinator address: set WorkerOptions::coordinator_address or ",
        kCoordinatorAddressEnv, " to the HOST:PORT of shardcoordd"));
  }
  if (options_.job_id.empty() || options_.rank < 0 || options_.world_size <= 0 ||
      options_.group_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "WorkerOptions incomplete: job_id='", options_.job_id, "' rank=", options_.rank,
        " world_size=", options_.world_size, " group_size=", options_.group_size,
        "; all four are required"));
  }
  IgnoreSigpipeOnce();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  if (absl::Status s = Connect(deadline); !s.ok()) return s;
  if (!stream_->Write(RegisterMessage())) {
    ctx_.TryCancel();
    stream_->Finish();
    return absl::UnavailableError(absl::StrCat("coordinator at ", address_,
                                               " closed the session before registration"));
  }
  reader_ = std::thread([this] { ReaderLoop(); });
  return AwaitRegistered(deadline);
}

absl::Status Worker::Impl::Connect(absl::Time deadline) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kWorkerMaxReceiveBytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // A fresh channel per worker: a reconnecting trainer must not reuse a broken one.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  channel_ = grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
  if (!channel_->WaitForConnected(absl::ToChronoTime(deadline))) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach coordinator at ", address_, " within ",
        absl::ToInt64Milliseconds(options_.connect_timeout),
        " ms; is shardcoordd running there? (", Prefix(), ")"));
  }
  stub_ = std::shared_ptr<v1::Coordinator::Stub>(v1::Coordinator::NewStub(channel_));
  stream_ = stub_->Session(&ctx_);
  return absl::OkStatus();
}

v1::WorkerMessage Worker::Impl::RegisterMessage() const {
  v1::WorkerMessage reg_msg;
  v1::RegisterRequest* reg = reg_msg.mutable_register_();
  reg->set_job_id(options_.job_id);
  reg->set_rank(options_.rank);
  reg->set_world_size(options_.world_size);
  reg->set_group_size(options_.group_size);
  for (const auto& m : options_.modules) ToProto(m, reg->add_modules());
  reg->set_policy(ToProto(options_.policy));
  reg->set_fallback(ToProto(options_.fallback));
  reg->set_wrap_outer_model(options_.wrap_outer_model);
  reg->set_lookahead(options_.lookahead);
  reg->set_memory_budget_bytes(options_.memory_budget_bytes);
  reg->set_host(HostName());
  reg->set_pid(getpid());
  return reg_msg;
}

absl::Status Worker::Impl::AwaitRegistered(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return registered_ || reader_done_; };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  if (!registered_) {
    absl::Status s = reader_done_ ? session_status_
                                  : absl::DeadlineExceededError(absl::StrCat(
                                        "registration with ", address_, " not answered within ",
                                        absl::ToInt64Milliseconds(options_.connect_timeout), " ms"));
    mu_.Unlock();
    ctx_.TryCancel();
    reader_.join();
    mu_.Lock();
    closed_ = true;
    return s;
  }
  writer_started_ = true;
  writer_ = std::thread([this] { WriterLoop(); });
  log_->info("{} registered coordinator={} group={} ranks={} epoch={} policy={} fallback={} lookahead={}",
             Prefix(), address_, group_.group, RanksOf(group_.ranks), group_.epoch,
             PolicyName(group_.policy), FallbackName(group_.fallback), group_.lookahead);
  for (const auto& w : group_.warnings) log_->warn("{} {}", Prefix(), w);
  return absl::OkStatus();
}

void Worker::Impl::ReaderLoop() {
  v1::CoordinatorMessage msg;
  while (stream_->Read(&msg)) {
    PendingAborts aborts;
    {
      absl::MutexLock lock(&mu_);
      Handle(msg, &aborts);
    }
    for (auto& [comm, reason] : aborts.aborts) comm->Abort(reason);
    if (!aborts.acks.empty()) {
      absl::MutexLock lock(&mu_);
      ready_acks_.insert(ready_acks_.end(), aborts.acks.begin(), aborts.acks.end());
    }
  }
  {
    // Finish may only run once the writer no longer writes: stop it first. Its Write
    // fails fast on an ended stream.
    absl::MutexLock lock(&mu_);
    read_ended_ = true;
    auto writer_stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !writer_started_ || writer_done_;
    };
    mu_.Await(absl::Condition(&writer_stopped));
  }
  grpc::Status st = stream_->Finish();
  absl::MutexLock lock(&mu_);
  reader_done_ = true;
  if (!registered_) {
    // Registration refused: the coordinator's status says why.
    session_status_ = st.ok() ? absl::UnavailableError(absl::StrCat(
                                    "coordinator at ", address_, " ended the session before "
                                    "answering the registration"))
                              : FromGrpcStatus(st);
    return;
  }
  if (session_status_.ok()) {
    session_status_ = absl::UnavailableError(absl::StrCat(
        "session with coordinator at ", address_, " lost (", Prefix(), "): ",
        st.ok() ? std::string("stream closed") : st.error_message(),
        closing_ ? "" : "; create a new Worker to register again"));
  }
  // Every pending decision fails now instead of waiting for its deadline.
  queue_.FailPending(session_status_);
  if (!closing_) log_->error("{} {}", Prefix(), std::string(session_status_.message()));
  // Without a session this rank is out of the job: the coordinator already told the others
  // to abort, so our communicators must not go on waiting for them.
  std::vector<std::shared_ptr<internal::AbortableCommunicator>> open;
  for (auto& [name, weak] : comms_) {
    if (auto c = weak.lock()) open.push_back(std::move(c));
  }
  const std::string why(session_status_.message());
  mu_.Unlock();
  for (auto& c : open) c->Abort(why);
  mu_.Lock();
}

void Worker::Impl::Handle(const v1::CoordinatorMessage& msg, PendingAborts* aborts) {
  switch (msg.kind_case()) {
    case v1::CoordinatorMessage::kRegistered:
      OnRegistered(msg.registered());
      break;
    case v1::CoordinatorMessage::kDecisions:
      for (const auto& pd : msg.decisions().decisions()) {
        queue_.Decide({pd.step(), pd.microbatch()}, FromProto(pd));  // Ignored unless pending.
      }
      break;
    case v1::CoordinatorMessage::kPlanRejected:
      OnPlanRejected(msg.plan_rejected());
      break;
    case v1::CoordinatorMessage::kMicrobatchFailed: {
      const auto& f = msg.microbatch_failed();
      MicrobatchKey key{f.step(), f.microbatch()};
      log_->error("{} step={} mb={} microbatch failed: {}", Prefix(), key.step, key.microbatch, f.message());
      queue_.Fail(key, MakeStatus(f.code(), f.message()));  // Also a decision not taken yet.
      break;
    }
    case v1::CoordinatorMessage::kGroupFailure: {
      const auto& g = msg.group_failure();
      group_failure_ = g.reason();
      outbox_.clear();  // Plans for the failed epoch must not reach the next one.
      const int cancelled = queue_.FailPending(absl::AbortedError(g.reason()));
      log_->error("{} {} (cancelled {} pending decisions here)", Prefix(), g.reason(), cancelled);
      break;
    }
    case v1::CoordinatorMessage::kCommAbort: {
      const auto& a = msg.comm_abort();
      auto it = comms_.find(a.name());
      auto comm = it == comms_.end() ? nullptr : it->second.lock();
      if (comm && comm->epoch() == a.epoch()) aborts->aborts.emplace_back(comm, a.reason());
      // Acknowledged once aborted (the reader does it right after, see ReaderLoop): the
      // coordinator starts the next epoch only when every live member has.
      aborts->acks.push_back({a.name(), a.epoch()});
      break;
    }
    case v1::CoordinatorMessage::kNotice:
      OnNotice(msg.notice());
      break;
    default:
      break;
  }
}

void Worker::Impl::OnRegistered(const v1::RegisterResponse& r) {
  group_.group = r.group();
  group_.ranks.assign(r.group_ranks().begin(), r.group_ranks().end());
  group_.epoch = r.epoch();
  group_.policy = FromProto(r.policy());
  group_.fallback = FromProto(r.fallback());
  group_.lookahead = r.lookahead();
  group_.heartbeat_interval = absl::Milliseconds(r.heartbeat_interval_ms());
  group_.warnings.assign(r.warnings().begin(), r.warnings().end());
  registered_ = true;
}

void Worker::Impl::OnPlanRejected(const v1::PlanRejected& r) {
  MicrobatchKey key{r.step(), r.microbatch()};
  if (r.epoch() != group_.epoch) {
    // Sent before the group failed, rejected after it re-formed: not about this epoch's plan.
    log_->debug("{} step={} mb={} epoch {} plan rejected after re-forming: {}", Prefix(), key.step,
                key.microbatch, r.epoch(), r.message());
    return;
  }
  log_->warn("{} step={} mb={} plan rejected: {}", Prefix(), key.step, key.microbatch, r.message());
  queue_.Reject(key, MakeStatus(r.code(), r.message()));
}

void Worker::Impl::OnNotice(const v1::Notice& n) {
  if (n.kind() == v1::Notice::KIND_GROUP_REFORMED) {
    group_failure_.clear();
    group_.epoch = n.epoch();
    queue_.ResetKeys();  // Keys start afresh in the new epoch (the coordinator's rule).
    log_->info("{} {}", Prefix(), n.message());
  } else if (n.kind() == v1::Notice::KIND_RANK_LOST) {
    if (job_failure_.empty()) {  // The first loss is the cause; later ones follow from it.
      job_failure_ = absl::StrCat("rank ", n.rank(), " of another shard group of this job was lost: ", n.message());
    }
    log_->error("{} {}", Prefix(), job_failure_);
  } else if (n.kind() == v1::Notice::KIND_SHUTDOWN) {
    session_status_ =
        absl::UnavailableError(absl::StrCat("coordinator at ", address_, " is shutting down (", Prefix(), ")"));
    log_->warn("{} {}", Prefix(), n.message());
  }
}

void Worker::Impl::WriterLoop() {
  absl::Duration interval;
  {
    absl::MutexLock lock(&mu_);
    interval = group_.heartbeat_interval > absl::ZeroDuration() ? group_.heartbeat_interval
                                                                : absl::Milliseconds(500);
  }
  absl::Time last_heartbeat = absl::Now();
  while (true) {
    v1::WorkerMessage msg;
    bool goodbye = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !outbox_.empty() || !ready_acks_.empty() || memory_dirty_ || closing_ || read_ended_;
      };
      mu_.AwaitWithDeadline(absl::Condition(&ready), last_heartbeat + interval);
      if (read_ended_) break;
      if (absl::Now() >= last_heartbeat + interval || (memory_dirty_ && outbox_.empty())) {
        // Heartbeats go out on time even while plans flow: they carry collective progress.
        auto* hb = msg.mutable_heartbeat();
        hb->set_sent_unix_ms(absl::ToUnixMillis(absl::Now()));
        for (const auto& [name, weak] : comms_) {
          auto comm = weak.lock();
          if (!comm) continue;
          auto* p = hb->add_comms();
          p->set_name(name);
          p->set_epoch(comm->epoch());
          int64_t issued = 0, completed = 0;
          comm->Progress(&issued, &completed);
          p->set_issued(issued);
          p->set_completed(completed);
        }
        for (const auto& m : memory_) {
          auto* pm = hb->add_memory();
          pm->set_module(m.module);
          pm->set_resident_bytes(m.resident_bytes);
          pm->set_peak_bytes(m.peak_bytes);
          pm->set_gathered_bytes(m.gathered_bytes);
        }
        memory_dirty_ = false;
        last_heartbeat = absl::Now();
      } else if (!ready_acks_.empty()) {
        auto* ack = msg.mutable_comm_aborted();
        ack->set_name(ready_acks_.front().first);
        ack->set_epoch(ready_acks_.front().second);
        ready_acks_.erase(ready_acks_.begin());
      } else if (!outbox_.empty()) {
        auto* batch = msg.mutable_plans();
        batch->set_epoch(group_.epoch);
        while (!outbox_.empty()) {
          *batch->add_plans() = std::move(outbox_.front());
          outbox_.pop_front();
        }
      } else if (closing_) {
        msg.mutable_goodbye()->set_reason("worker closed");
        goodbye = true;
      } else {
        continue;  // Woken early with nothing to send.
      }
    }
    if (!stream_->Write(msg)) break;  // The reader sees the end and records why.
    if (goodbye) {
      stream_->WritesDone();
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  writer_done_ = true;
}

absl::Status Worker::Impl::ReportPlan(const MicrobatchPlan& plan) {
  const std::string where = absl::StrCat("plan ", plan.key.ToString(), " (", Prefix(), ")");
  // The same checks as the coordinator's (contract/plan_check.h), before anything is sent.
  auto bad = [&](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat(where, ": ", what)); };
  if (std::string e = CheckPlanKey(plan.key); !e.empty()) return bad(e);
  for (const auto& [name, calls] : plan.calls) {
    const bool known = module_names_.count(name) > 0;
    if (std::string e = CheckPlanCall(name, calls, known, known ? std::vector<std::string>{} : module_list_);
        !e.empty()) {
      return bad(e);
    }
  }
  absl::MutexLock lock(&mu_);
  if (!session_status_.ok()) return session_status_;
  if (!group_failure_.empty()) {
    return absl::AbortedError(absl::StrCat(where, " not sent: ", group_failure_,
                                           "; wait for the group to re-form"));
  }
  if (absl::Status s = queue_.Add(plan.key, group_.lookahead, where); !s.ok()) return s;
  v1::MicrobatchPlan pp;
  ToProto(plan, &pp);
  outbox_.push_back(std::move(pp));
  return absl::OkStatus();
}

absl::StatusOr<MicrobatchDecision> Worker::Impl::GetDecision(const MicrobatchKey& key,
                                                             absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (!queue_.Contains(key)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no plan was reported for ", key.ToString(), " (", Prefix(),
        "), or its decision was already taken; call ReportPlan before GetDecision"));
  }
  // Another thread's GetDecision may take this entry while we wait: look it up each time.
  auto resolved = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.Resolved(key); };
  mu_.AwaitWithTimeout(absl::Condition(&resolved), timeout);
  if (!queue_.Contains(key)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the decision for ", key.ToString(), " (", Prefix(),
        ") was dropped while waiting: another thread took a later microbatch's decision"));
  }
  if (!queue_.Resolved(key)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "no decision for ", key.ToString(), " within ", absl::ToInt64Milliseconds(timeout),
        " ms (", Prefix(), ", group ", group_.group, " ranks ", RanksOf(group_.ranks),
        "): some rank of the group has not reported its plan yet"));
  }
  return queue_.Take(key);  // Entries up to this key are done with: the trainer moves forward.
}

void Worker::Impl::Close(absl::Duration timeout) {
  absl::MutexLock close_lock(&close_mu_);
  if (closed_) return;
  closed_ = true;
  const absl::Time deadline = absl::Now() + timeout;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    if (!writer_started_) {
      // Never registered: there is no session to leave.
      mu_.Unlock();
      ctx_.TryCancel();
      if (reader_.joinable()) reader_.join();
      mu_.Lock();
      return;
    }
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writer_done_; };
    mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
    auto reader_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reader_done_; };
    mu_.AwaitWithDeadline(absl::Condition(&reader_done), deadline);
    if (!reader_done_) {
      log_->warn("{} coordinator did not end the session within {} ms; cancelling", Prefix(),
                 absl::ToInt64Milliseconds(timeout));
    }
  }
  ctx_.TryCancel();
  if (writer_.joinable()) writer_.join();
  if (reader_.joinable()) reader_.join();
}

bool HasNcclBackend() {
#ifdef SHARDCOORD_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::shared_ptr<Communicator>> Worker::Impl::OpenCommunicator(const CommunicatorOptions& options) {
  if (options.backend == Backend::kNccl && !HasNcclBackend()) {
    return absl::UnimplementedError(
        "this build of the shardcoord worker has no NCCL backend: rebuild with -DSHARDCOORD_WITH_NCCL=ON");
  }
  std::string name = options.name;
  {
    absl::MutexLock lock(&mu_);
    if (!session_status_.ok()) return session_status_;
    if (name == "group") name = absl::StrCat("group/", group_.group);
  }
  v1::CommJoinRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(options_.rank);
  req.set_name(name);
  for (int r : options.ranks) req.add_ranks(r);
  req.set_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options.join_timeout)));
  v1::CommJoinResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.join_timeout + absl::Seconds(5)));
  grpc::Status st = stub_->CommJoin(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  internal::CommEndpoint ep{stub_, address_, options_.job_id, options_.rank};
  std::vector<int> ranks(resp.ranks().begin(), resp.ranks().end());
  std::shared_ptr<internal::AbortableCommunicator> comm;
  if (options.backend == Backend::kNccl) {
#ifdef SHARDCOORD_HAVE_NCCL
    comm = internal::MakeNcclCommunicator(ep, name, resp.epoch(), std::move(ranks), options);
#endif
  } else {
    comm = internal::MakeGlooCommunicator(ep, name, resp.epoch(), std::move(ranks), options);
  }
  {
    absl::MutexLock lock(&mu_);
    comms_[name] = comm;  // Before connecting: an abort during the rendezvous must reach it.
  }
  log_->info("{} comm={} epoch={} joining ranks={}{}", Prefix(), name, resp.epoch(), absl::StrJoin(resp.ranks(), ","),
             resp.previous_abort_reason().empty() ? "" : " (previous epoch aborted: " + resp.previous_abort_reason() + ")");
  if (absl::Status s = comm->Connect(); !s.ok()) return s;
  return std::shared_ptr<Communicator>(comm);
}

absl::StatusOr<std::shared_ptr<Communicator>> Worker::OpenCommunicator(const CommunicatorOptions& options) {
  return impl_->OpenCommunicator(options);
}

Worker::Worker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() = default;

absl::StatusOr<std::unique_ptr<Worker>> Worker::Connect(WorkerOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  absl::Status s = impl->Start();
  if (!s.ok()) return s;
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

GroupInfo Worker::group() const { return impl_->group(); }
absl::Status Worker::ReportPlan(const MicrobatchPlan& plan) { return impl_->ReportPlan(plan); }
absl::StatusOr<MicrobatchDecision> Worker::GetDecision(const MicrobatchKey& key,
                                                       absl::Duration timeout) {
  return impl_->GetDecision(key, timeout);
}
absl::Status Worker::AwaitGroupReady(absl::Duration timeout) {
  return impl_->AwaitGroupReady(timeout);
}
void Worker::ReportMemory(const std::vector<ModuleMemoryUsage>& usage) { impl_->ReportMemory(usage); }
int Worker::UndecidedPlans() const { return impl_->UndecidedPlans(); }
absl::Status Worker::Health() const { return impl_->Health(); }
absl::Status Worker::JobHealth() const { return impl_->JobHealth(); }
void Worker::Close(absl::Duration timeout) { impl_->Close(timeout); }

}  // namespace shardcoord
