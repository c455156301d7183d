// Worker::Impl, part 1: the public API, registration, plans and decisions, Close and
// communicators. The session stream's threads are in worker_session.cc; the class in
// worker_impl.h.
#include "worker_impl.h"

#include <chrono>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "shardcoord/address.h"
#include "shardcoord/channel_credentials.h"

namespace shardcoord {
namespace internal {

std::string RanksOf(const std::vector<int>& ranks) {
  if (ranks.size() <= 16) return absl::StrJoin(ranks, ",");
  return absl::StrCat(ranks.front(), "..", ranks.back(), " (", ranks.size(), " ranks)");
}

}  // namespace internal

namespace {

using internal::kKeepaliveTimeMs;
using internal::kKeepaliveTimeoutMs;
using internal::kWorkerMaxReceiveBytes;
using internal::RanksOf;

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

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

// What else may keep a connection from forming: TLS on one side only, or a certificate the
// other side does not accept (gRPC tells only "failed to connect").
constexpr absl::Duration kFirstConnectWait = absl::Seconds(1);

std::string ConnectHint(const TlsFiles& tls) {
  if (!tls.enabled()) return " If it serves TLS, give the CA file ($SHARDCOORD_TLS_CA).";
  return " If it does, check that it serves TLS, that its certificate is signed by $SHARDCOORD_TLS_CA and names "
         "the host dialled (or set $SHARDCOORD_TLS_SERVER_NAME), and, under mutual TLS, the client certificate.";
}

}  // namespace


absl::StatusOr<std::string> ResolveToken(const std::string& explicit_token) {
  if (!explicit_token.empty()) return explicit_token;
  if (const char* env = std::getenv(kTokenEnv); env != nullptr && *env != '\0') return std::string(env);
  const char* file = std::getenv(kTokenFileEnv);
  if (file == nullptr || *file == '\0') return std::string();
  std::ifstream in(file);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return absl::NotFoundError(absl::StrCat("$", kTokenFileEnv, " names ", file, ", which cannot be read"));
  }
  return std::string(absl::StripAsciiWhitespace(line));
}

// The job, rank and sizes a registration needs, each named when it is wrong.
static absl::Status CheckIdentity(const WorkerOptions& o) {
  if (o.job_id.empty()) return absl::InvalidArgumentError("job_id is empty: give the job's id, the same on every rank");
  if (o.world_size <= 0) return absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", o.world_size));
  if (o.rank < 0) {  // A rank past the world is the coordinator's to name ("unknown rank").
    return absl::InvalidArgumentError(absl::StrCat("rank must be >= 0, got ", o.rank));
  }
  if (o.group_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("group_size must be >= 1 (the FSDP shard group's size), got ",
                                                   o.group_size));
  }
  return absl::OkStatus();
}

absl::Status Worker::Impl::Start() {
  address_ = options_.coordinator_address;
  if (address_.empty()) {
    if (const char* env = std::getenv(kCoordinatorAddressEnv)) address_ = env;
  }
  if (address_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no coordinator address: set $", kCoordinatorAddressEnv, " to the HOST:PORT of shardcoordd (or give it: "
        "address= in Python, WorkerOptions::coordinator_address in C++)"));
  }
  if (std::string problem = AddressProblem(address_); !problem.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator address '", address_, "' is not HOST:PORT: ", problem));
  }
  if (absl::Status s = CheckIdentity(options_); !s.ok()) return s;
  auto token = ResolveToken(options_.token);
  if (!token.ok()) return token.status();
  token_ = *token;
  tls_ = ResolveTls(options_.tls);  // Unusable files fail the first Connect, finally (not UNAVAILABLE).
  IgnoreSigpipeOnce();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  // A coordinator lost before it answered (killed, restarting) is tried again until the
  // connect timeout; a refusal is final.
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    absl::Status s = RegisterOnce(deadline);
    if (s.code() != absl::StatusCode::kUnavailable || absl::Now() + backoff >= deadline) return s;
    log_->warn("{} registration not answered ({}); trying again", Prefix(), std::string(s.message()));
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
    absl::MutexLock lock(&mu_);
    reader_done_ = false;
    read_ended_ = false;
    session_status_ = absl::OkStatus();
    closed_ = false;
  }
}

absl::Status Worker::Impl::RegisterOnce(absl::Time deadline) {
  if (absl::Status s = Connect(deadline); !s.ok()) return s;
  if (!stream_->Write(RegisterMessage())) {
    {
      absl::MutexLock lock(&mu_);
      ctx_->TryCancel();
    }
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
  auto creds = ChannelCredentialsFor(tls_, args);
  if (!creds.ok()) return creds.status();
  auto channel = grpc::CreateCustomChannel(address_, *creds, args);
  const absl::Time start = absl::Now();
  // A first short wait: what is wrong with the address is said within a second where it can be
  // known (a name that does not resolve is final; a refusal may be a daemon still starting).
  if (!channel->WaitForConnected(absl::ToChronoTime(std::min(deadline, start + kFirstConnectWait)))) {
    const std::string problem = ReachProblem(address_, kFirstConnectWait);
    if (absl::StartsWith(problem, "the host")) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot reach coordinator at ", address_, ": ", problem, " (", Prefix(), ")"));
    }
    if (!problem.empty()) {
      log_->warn("{} coordinator at {}: {}; waiting until the connect timeout", Prefix(), address_, problem);
    }
    if (!channel->WaitForConnected(absl::ToChronoTime(deadline))) {
      const std::string now = ReachProblem(address_, kFirstConnectWait);
      return absl::UnavailableError(absl::StrCat(
          "cannot reach coordinator at ", address_, " within ", absl::ToInt64Milliseconds(deadline - start), " ms: ",
          now.empty() ? "something accepts TCP connections there, but not as a shardcoordd serving gRPC as this "
                        "worker dials it (TLS on one side only, or another program on that port)."
                      : now + "; is shardcoordd running there?",
          ConnectHint(tls_), " (", Prefix(), ")"));
    }
  }
  auto stub = std::shared_ptr<v1::Coordinator::Stub>(v1::Coordinator::NewStub(channel));
  absl::MutexLock lock(&mu_);
  if (closing_) return absl::CancelledError(absl::StrCat("worker closed (", Prefix(), ")"));
  channel_ = std::move(channel);
  stub_ = std::move(stub);
  ctx_ = std::make_unique<grpc::ClientContext>();
  if (!token_.empty()) ctx_->AddMetadata("authorization", "Bearer " + token_);
  stream_ = stub_->Session(ctx_.get());
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
  reg->set_wire_revision(kWireRevision);
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
    ctx_->TryCancel();
    mu_.Unlock();
    reader_.join();
    mu_.Lock();
    closed_ = true;
    return s;
  }
  StartWriterLocked();
  log_->info("{} registered coordinator={} (shardcoordd {}) group={} ranks={} epoch={} policy={} fallback={} "
             "lookahead={}",
             Prefix(), address_, coordinator_version_.empty() ? "version not reported" : coordinator_version_, group_.group,
             RanksOf(group_.ranks), group_.epoch,
             PolicyName(group_.policy), FallbackName(group_.fallback), group_.lookahead);
  for (const auto& w : group_.warnings) log_->warn("{} {}", Prefix(), w);
  if (options_.modules.empty()) {
    log_->warn("{} registered with no controlled module: nothing is coordinated, and every decision is empty. "
               "Build the manifest from the model (shardcoord.torch.manifest, torchx::BuildManifest) and pass "
               "the names of frozen towers it does not recognize as extra tower names",
               Prefix());
  }
  return absl::OkStatus();
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
  if (absl::Status s = queue_.Add(plan.key, group_.lookahead, where, plan); !s.ok()) return s;
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
  if (!queue_.Resolved(key)) {  // A stall: the decision was not in the window when the trainer asked.
    const auto start = std::chrono::steady_clock::now();  // Not the wall clock: it may step.
    mu_.AwaitWithTimeout(absl::Condition(&resolved), timeout);
    decision_stalls_++;
    decision_stall_time_ += absl::FromChrono(std::chrono::steady_clock::now() - start);
  }
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

void Worker::Impl::Close(absl::Duration timeout, const std::string& reason, bool failed) {
  absl::MutexLock close_lock(&close_mu_);
  if (closed_) return;
  closed_ = true;
  const absl::Time deadline = absl::Now() + timeout;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    close_reason_ = reason;
    close_failed_ = failed;
    if (!writer_started_) {
      // Never registered: there is no session to leave.
      if (ctx_) ctx_->TryCancel();
      mu_.Unlock();
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
    ctx_->TryCancel();  // Also ends a resume in progress (it checks closing_ too).
  }
  // The reader first: a resume it finished while this Close waited starts a new writer
  // (StartWriterLocked, on the reader's thread), so writer_ is only settled once the reader has
  // ended. Joining the writer first read writer_ while the reader could assign it, and could leave
  // the new writer joinable at destruction ("terminate called without an active exception").
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
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
  std::shared_ptr<v1::Coordinator::Stub> stub;
  {
    absl::MutexLock lock(&mu_);
    if (!session_status_.ok()) return session_status_;
    if (name == "group") name = absl::StrCat("group/", group_.group);
    stub = stub_;
  }
  v1::CommJoinRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(options_.rank);
  req.set_name(name);
  for (int r : options.ranks) req.add_ranks(r);
  req.set_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options.join_timeout)));
  req.set_session_key(session_key_->Get());
  v1::CommJoinResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.join_timeout + absl::Seconds(5)));
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  grpc::Status st = stub->CommJoin(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  internal::CommSpec spec{options_.job_id, options_.rank, name, resp.epoch(),
                          std::vector<int>(resp.ranks().begin(), resp.ranks().end()), options};
  auto rendezvous =
      internal::MakeCoordinatorRendezvous({stub, options_.job_id, options_.rank, session_key_, token_}, name,
                                          resp.epoch());
  std::shared_ptr<internal::AbortableCommunicator> comm;
  if (options.backend == Backend::kNccl) {
#ifdef SHARDCOORD_HAVE_NCCL
    comm = internal::MakeNcclCommunicator(std::move(rendezvous), std::move(spec));
#endif
  } else {
    comm = internal::MakeGlooCommunicator(std::move(rendezvous), std::move(spec));
  }
  comms_.Add(comm);  // Before connecting: an abort during the rendezvous must reach it.
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
void Worker::ReportCosts(const std::vector<ModuleCost>& costs, int64_t frozen_budget_bytes) {
  impl_->ReportCosts(costs, frozen_budget_bytes);
}
int Worker::UndecidedPlans() const { return impl_->UndecidedPlans(); }
absl::Status Worker::Health() const { return impl_->Health(); }
absl::Status Worker::JobHealth() const { return impl_->JobHealth(); }
void Worker::Close(absl::Duration timeout) { impl_->Close(timeout); }
void Worker::Close(const std::string& reason, absl::Duration timeout) { impl_->Close(timeout, reason); }
void Worker::Fail(const std::string& error, absl::Duration timeout) {
  impl_->Close(timeout, error.empty() ? std::string("stopped on an error") : error, /*failed=*/true);
}

}  // namespace shardcoord
