// The gRPC side of the daemon: one SessionReactor per rank stream feeding CoordinatorCore, a
// bounded outbox per session, the tick and self-check threads (threads and locks: DESIGN 9).
#include "coordinator/coordinator_server.h"

#include "coordinator/auth.h"
#include "coordinator/http_server.h"
#include "coordinator/tls.h"

#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace shardcoord::coordinator {
namespace {

// Consecutive decision messages queued for a rank are written as one message, up to a
// count and a size (a decision lists every module: a big manifest makes big decisions, and
// the worker's receive limit is kWorkerMaxReceiveBytes, see worker.cc).
constexpr int kMaxDecisionsPerWrite = 256;
constexpr size_t kMaxBytesPerWrite = 1 << 20;

class SessionReactor;

// The RankSink of one session: a write queue in front of the reactor. The core may call
// it after the stream is gone; it then drops messages. Thread-safe.
class SessionSink final : public RankSink {
 public:
  SessionSink(SessionReactor* reactor, int64_t max_bytes, uint64_t incarnation)
      : reactor_(reactor), max_bytes_(max_bytes), incarnation_(incarnation) {}

  // Refuses (false) once more than max_bytes are queued: the rank does not read.
  bool Send(const v1::CoordinatorMessage& msg) override;
  void Close(const absl::Status& status) override;
  void OnWriteDone(bool ok);
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  // Starts the next write or the finish, if nothing is in flight. Called with mu_ held;
  // releases it before touching the reactor (its reactions may run inline).
  void StartNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_UNLOCK_FUNCTION(mu_);

  absl::Mutex mu_;
  SessionReactor* reactor_ ABSL_GUARDED_BY(mu_);
  const int64_t max_bytes_;
  const uint64_t incarnation_;  // Stamped on every message (DESIGN 12).
  std::deque<std::pair<v1::CoordinatorMessage, size_t>> queue_ ABSL_GUARDED_BY(mu_);  // (message, size)
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool overflowed_ ABSL_GUARDED_BY(mu_) = false;  // A Send was refused.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  v1::CoordinatorMessage current_;  // Owned by the write in flight.
};

class SessionReactor final
    : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  // `job_scope`: the only job this session may register for (its token's); "" for any.
  SessionReactor(CoordinatorCore* core, uint64_t id, std::string peer, std::string job_scope)
      : core_(core),
        id_(id),
        peer_(std::move(peer)),
        job_scope_(std::move(job_scope)),
        sink_(std::make_shared<SessionSink>(this, core->options().limits.max_outbox_bytes, core->incarnation())) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      core_->OnSessionClosed(id_, absl::StrCat("stream from ", peer_, " ended"));
      sink_->Close(absl::OkStatus());
      return;
    }
    if (!registered_) {
      if (in_.kind_case() != v1::WorkerMessage::kRegister) {
        sink_->Close(absl::FailedPreconditionError(
            "the first message of a Session must be `register`; send a RegisterRequest first"));
        return;
      }
      absl::Status s = Grant{Role::kRank, job_scope_}.AllowsJob(in_.register_().job_id(), "register");
      if (s.ok()) s = core_->Register(id_, in_.register_(), sink_);
      if (!s.ok()) {
        sink_->Close(s);
        return;
      }
      registered_ = true;
      StartRead(&in_);
      return;
    }
    if (in_.incarnation() != 0 && in_.incarnation() != core_->incarnation()) {
      const std::string why = absl::StrCat("message meant for coordinator incarnation ", in_.incarnation(),
                                           ", but this is incarnation ", core_->incarnation(),
                                           ": the coordinator restarted; the worker must resume");
      sink_->Close(absl::FailedPreconditionError(why));
      core_->OnSessionClosed(id_, why);
      return;
    }
    switch (in_.kind_case()) {
      case v1::WorkerMessage::kPlans:
        core_->OnPlans(id_, in_.plans());
        break;
      case v1::WorkerMessage::kHeartbeat:
        core_->OnHeartbeat(id_, in_.heartbeat());
        break;
      case v1::WorkerMessage::kCommAborted:
        core_->OnCommAborted(id_, in_.comm_aborted());
        break;
      case v1::WorkerMessage::kGoodbye:
        core_->OnGoodbye(id_, in_.goodbye().reason());
        sink_->Close(absl::OkStatus());
        return;
      case v1::WorkerMessage::kRegister:
        // The client's error first (the core's "declared dead" close then finds it closed).
        sink_->Close(absl::FailedPreconditionError(
            "`register` may only be the first message of a Session; open a new stream to "
            "register again"));
        core_->OnSessionClosed(id_, "register sent twice on one stream");
        return;
      default:
        break;  // An empty message (a newer client's unknown kind): ignored.
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override { sink_->OnWriteDone(ok); }

  void OnCancel() override { core_->OnSessionClosed(id_, absl::StrCat("stream from ", peer_, " cancelled")); }

  void OnDone() override {
    sink_->Detach();
    core_->OnSessionClosed(id_, absl::StrCat("stream from ", peer_, " done"));
    delete this;
  }

 private:
  CoordinatorCore* const core_;
  const uint64_t id_;
  const std::string peer_;
  const std::string job_scope_;
  std::shared_ptr<SessionSink> sink_;
  v1::WorkerMessage in_;
  bool registered_ = false;
};

bool SessionSink::Send(const v1::CoordinatorMessage& msg) {
  const size_t size = msg.ByteSizeLong();
  mu_.Lock();
  if (reactor_ == nullptr || finish_.has_value()) {
    mu_.Unlock();
    return true;  // Closing: nothing more goes out, and that is not the rank's fault.
  }
  if (overflowed_ || queued_bytes_ + static_cast<int64_t>(size) > max_bytes_) {
    overflowed_ = true;
    mu_.Unlock();
    return false;
  }
  queue_.emplace_back(msg, size);
  queue_.back().first.set_incarnation(incarnation_);
  queued_bytes_ += static_cast<int64_t>(size);
  if (writing_) {
    mu_.Unlock();
    return true;
  }
  StartNextLocked();
  return true;
}

void SessionSink::Close(const absl::Status& status) {
  mu_.Lock();
  if (reactor_ == nullptr || finish_.has_value()) {
    mu_.Unlock();
    return;
  }
  finish_ = ToGrpcStatus(status);
  if (overflowed_) {
    // The rank stopped reading: what is queued would only wait behind the stuck write.
    queue_.clear();
    queued_bytes_ = 0;
  }
  if (writing_) {
    mu_.Unlock();
    return;
  }
  StartNextLocked();
}

void SessionSink::OnWriteDone(bool ok) {
  mu_.Lock();
  writing_ = false;
  if (!ok) {
    // The stream is broken; nothing more can be written.
    queue_.clear();
    queued_bytes_ = 0;
    if (!finish_) finish_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed");
  }
  StartNextLocked();
}

void SessionSink::StartNextLocked() {
  SessionReactor* reactor = reactor_;
  if (reactor == nullptr) {
    mu_.Unlock();
    return;
  }
  if (!queue_.empty()) {
    current_ = std::move(queue_.front().first);
    size_t bytes = queue_.front().second;
    queued_bytes_ -= static_cast<int64_t>(bytes);
    queue_.pop_front();
    if (current_.has_decisions()) {
      auto* batch = current_.mutable_decisions();
      while (!queue_.empty() && queue_.front().first.has_decisions() &&
             batch->decisions_size() + queue_.front().first.decisions().decisions_size() <= kMaxDecisionsPerWrite &&
             bytes + queue_.front().second <= kMaxBytesPerWrite) {
        for (auto& d : *queue_.front().first.mutable_decisions()->mutable_decisions()) {
          *batch->add_decisions() = std::move(d);
        }
        bytes += queue_.front().second;
        queued_bytes_ -= static_cast<int64_t>(queue_.front().second);
        queue_.pop_front();
      }
    }
    writing_ = true;
    mu_.Unlock();
    reactor->StartWrite(&current_);
    return;
  }
  if (finish_.has_value() && !finished_) {
    finished_ = true;
    grpc::Status st = *finish_;
    mu_.Unlock();
    reactor->Finish(st);
    return;
  }
  mu_.Unlock();
}

}  // namespace

constexpr int kMaxEventsPerQuery = 10000;

// A session stream refused before it starts (no token, or the wrong role).
class RefusedSession final : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  explicit RefusedSession(const grpc::Status& why) { Finish(why); }
  void OnDone() override { delete this; }
};

// The gRPC adapter: converts calls into CoordinatorCore calls after checking the caller's
// token (auth.h). No logic of its own.
class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  CoordinatorService(CoordinatorCore* core, Tokens tokens) : core_(core), tokens_(std::move(tokens)) {}

  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Session(
      grpc::CallbackServerContext* ctx) override {
    auto grant = Authorize(ctx, Role::kRank, "Session");
    if (!grant.ok()) return new RefusedSession(ToGrpcStatus(grant.status()));
    return new SessionReactor(core_, next_session_.fetch_add(1), ctx->peer(), grant->job);
  }

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx, const v1::StatusRequest* req,
                                      v1::StatusResponse* resp) override {
    auto grant = Authorize(ctx, Role::kRead, "GetStatus");
    if (!grant.ok()) return Refuse(ctx, ToGrpcStatus(grant.status()));
    auto job = JobOf(*grant, req->job_id(), "GetStatus");
    if (!job.ok()) return Refuse(ctx, ToGrpcStatus(job.status()));
    *resp = core_->Status(*job);
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* ListRanks(grpc::CallbackServerContext* ctx,
                                      const v1::ListRanksRequest* req,
                                      v1::ListRanksResponse* resp) override {
    auto grant = Authorize(ctx, Role::kRead, "ListRanks");
    if (!grant.ok()) return Refuse(ctx, ToGrpcStatus(grant.status()));
    auto job = JobOf(*grant, req->job_id(), "ListRanks");
    if (!job.ok()) return Refuse(ctx, ToGrpcStatus(job.status()));
    *resp = core_->Ranks(*job);
    // Process ids are for admins (they locate and signal processes); hosts stay, to find a rank.
    if (grant->role != Role::kAdmin) {
      for (auto& r : *resp->mutable_ranks()) r.clear_pid();
    }
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* ListGroups(grpc::CallbackServerContext* ctx,
                                       const v1::ListGroupsRequest* req,
                                       v1::ListGroupsResponse* resp) override {
    auto grant = Authorize(ctx, Role::kRead, "ListGroups");
    if (!grant.ok()) return Refuse(ctx, ToGrpcStatus(grant.status()));
    auto job = JobOf(*grant, req->job_id(), "ListGroups");
    if (!job.ok()) return Refuse(ctx, ToGrpcStatus(job.status()));
    *resp = core_->Groups(*job);
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* ListDecisions(grpc::CallbackServerContext* ctx,
                                          const v1::ListDecisionsRequest* req,
                                          v1::ListDecisionsResponse* resp) override {
    auto grant = Authorize(ctx, Role::kRead, "ListDecisions");
    if (!grant.ok()) return Refuse(ctx, ToGrpcStatus(grant.status()));
    auto job = JobOf(*grant, req->job_id(), "ListDecisions");
    if (!job.ok()) return Refuse(ctx, ToGrpcStatus(job.status()));
    *resp = core_->Decisions(*job, req->group(), req->limit());
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* ListEvents(grpc::CallbackServerContext* ctx,
                                       const v1::ListEventsRequest* req,
                                       v1::ListEventsResponse* resp) override {
    auto grant = Authorize(ctx, Role::kRead, "ListEvents");
    if (!grant.ok()) return Refuse(ctx, ToGrpcStatus(grant.status()));
    auto job = JobOf(*grant, req->job_id(), "ListEvents");
    if (!job.ok()) return Refuse(ctx, ToGrpcStatus(job.status()));
    // At most kMaxEventsPerQuery (a page; `after_id` pages on), so one query cannot make the
    // daemon build the whole journal in memory.
    const int limit = req->limit() > 0 ? std::min(req->limit(), kMaxEventsPerQuery) : 100;
    EventFilter filter{*job, req->kind(), req->since_unix_ms(), req->after_id(), limit};
    for (auto& e : core_->Events(filter)) {
      *resp->add_events() = std::move(e);
    }
    return Done(ctx);
  }

  grpc::ServerUnaryReactor* CommJoin(grpc::CallbackServerContext* ctx, const v1::CommJoinRequest* req,
                                     v1::CommJoinResponse* resp) override {
    if (grpc::Status st = AuthorizeRank(ctx, req->job_id(), "CommJoin"); !st.ok()) return Refuse(ctx, st);
    auto* r = ctx->DefaultReactor();
    core_->CommJoin(*req, [r, resp](absl::StatusOr<v1::CommJoinResponse> result) {
      if (result.ok()) *resp = std::move(*result);
      r->Finish(ToGrpcStatus(result.status()));
    });
    return r;
  }
  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* ctx, const v1::StoreSetRequest* req,
                                     v1::StoreSetResponse* resp) override {
    if (grpc::Status st = AuthorizeRank(ctx, req->job_id(), "StoreSet"); !st.ok()) return Refuse(ctx, st);
    auto* r = ctx->DefaultReactor();
    r->Finish(ToGrpcStatus(core_->StoreSet(*req)));
    return r;
  }
  grpc::ServerUnaryReactor* StoreGet(grpc::CallbackServerContext* ctx, const v1::StoreGetRequest* req,
                                     v1::StoreGetResponse* resp) override {
    if (grpc::Status st = AuthorizeRank(ctx, req->job_id(), "StoreGet"); !st.ok()) return Refuse(ctx, st);
    auto* r = ctx->DefaultReactor();
    core_->StoreGet(*req, [r, resp](absl::StatusOr<v1::StoreGetResponse> result) {
      if (result.ok()) *resp = std::move(*result);
      r->Finish(ToGrpcStatus(result.status()));
    });
    return r;
  }
  grpc::ServerUnaryReactor* CommReport(grpc::CallbackServerContext* ctx, const v1::CommReportRequest* req,
                                       v1::CommReportResponse* resp) override {
    if (grpc::Status st = AuthorizeRank(ctx, req->job_id(), "CommReport"); !st.ok()) return Refuse(ctx, st);
    auto* r = ctx->DefaultReactor();
    r->Finish(ToGrpcStatus(core_->CommReport(*req)));
    return r;
  }
  grpc::ServerUnaryReactor* ListComms(grpc::CallbackServerContext* ctx, const v1::ListCommsRequest* req,
                                      v1::ListCommsResponse* resp) override {
    auto grant = Authorize(ctx, Role::kRead, "ListComms");
    if (!grant.ok()) return Refuse(ctx, ToGrpcStatus(grant.status()));
    auto job = JobOf(*grant, req->job_id(), "ListComms");
    if (!job.ok()) return Refuse(ctx, ToGrpcStatus(job.status()));
    *resp = core_->Comms(*job);
    return Done(ctx);
  }

 private:
  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx) {
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
  static grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* ctx, const grpc::Status& why) {
    auto* r = ctx->DefaultReactor();
    r->Finish(why);
    return r;
  }
  absl::StatusOr<Grant> Authorize(grpc::CallbackServerContext* ctx, Role role, const char* method) const {
    if (!tokens_.enabled()) return Grant{};
    std::string authorization;
    auto it = ctx->client_metadata().find("authorization");
    if (it != ctx->client_metadata().end()) authorization.assign(it->second.data(), it->second.size());
    return tokens_.Check(authorization, role, method);
  }
  // A rank's call about `job_id`: the token's role and job must allow it.
  grpc::Status AuthorizeRank(grpc::CallbackServerContext* ctx, const std::string& job_id, const char* method) const {
    auto grant = Authorize(ctx, Role::kRank, method);
    if (!grant.ok()) return ToGrpcStatus(grant.status());
    return ToGrpcStatus(grant->AllowsJob(job_id, method));
  }
  // The job a query may see: the one asked for (all: ""), or, for a token of one job, that job.
  static absl::StatusOr<std::string> JobOf(const Grant& grant, const std::string& asked, const char* method) {
    if (asked.empty()) return grant.job;
    if (absl::Status s = grant.AllowsJob(asked, method); !s.ok()) return s;
    return asked;
  }

  CoordinatorCore* const core_;
  const Tokens tokens_;
  std::atomic<uint64_t> next_session_{1};
};

// Builds and starts the gRPC server on options.listen_address (port 0 picks one).
absl::Status CoordinatorServer::Listen(const CoordinatorOptions& options) {
  // grpc.health.v1.Health (built into gRPC; no token needed, it tells nothing but SERVING /
  // NOT_SERVING): for load balancers, Kubernetes gRPC probes and grpc_health_probe.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, ServerCredentialsFor(options.tls), &port_);
  builder.RegisterService(service_.get());
  // Workers send keepalive pings to notice a lost coordinator; let them.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // A second daemon on the same port must fail, not share the port and split the job.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  // Connections that never speak HTTP/2 (idle or hostile) hold a descriptor only this long.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(options.limits.handshake_timeout)));
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_address,
                                               ": address in use or not local; pick another "
                                               "--listen HOST:PORT (port 0 picks a free one)"));
  }
  const std::string& listen = options.listen_address;
  address_ = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port_);
  core_->SetBoundAddress(address_);
  if (auto* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(kHealthServiceName, true);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    CoordinatorOptions options, std::shared_ptr<const Clock> clock,
    std::function<void(const std::string&)> on_listener_lost) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  if (!clock) clock = std::make_shared<RealClock>();
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer);
  server->core_ = std::make_unique<CoordinatorCore>(options, clock);
  if (absl::Status s = CheckTls(options.tls); !s.ok()) return s;
  if (absl::Status s = server->core_->OpenJournal(); !s.ok()) return s;
  Tokens tokens = Tokens::None();
  if (!options.token_file.empty()) {
    auto loaded = Tokens::Load(options.token_file);
    if (!loaded.ok()) return loaded.status();
    tokens = *std::move(loaded);
  }
  const bool tokens_enabled = tokens.enabled();
  const Tokens http_tokens = tokens;
  server->service_ = std::make_unique<CoordinatorService>(server->core_.get(), std::move(tokens));

  if (absl::Status s = server->Listen(options); !s.ok()) return s;
  if (!options.http_listen.empty()) {
    auto http = HttpServer::Start(server->core_.get(), options, http_tokens);
    if (!http.ok()) {
      server->server_->Shutdown();
      return http.status();
    }
    server->http_ = std::move(*http);
  }
  server->ticker_ = std::make_unique<Ticker>(server->core_.get());
  server->ticker_->Start();
  server->on_listener_lost_ = std::move(on_listener_lost);
  server->StartSelfCheck(options);
  logging::Get("coordinator")
      ->info("serving address={} tls={} tokens={}", server->address_,
             !options.tls.enabled() ? "off" : options.tls.mutual() ? "mutual" : "on", tokens_enabled ? "on" : "off");
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(absl::Milliseconds(200)); }

std::string CoordinatorServer::http_address() const { return http_ ? http_->address() : std::string(); }

void CoordinatorServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    stopping_ = true;
  }
  if (ticker_) ticker_->Stop();
  if (self_check_.joinable()) self_check_.join();
  if (!server_) return;  // Never started serving.
  http_.reset();
  // NOT_SERVING first, so that health checkers stop sending work while sessions are told.
  if (auto* health = server_->GetHealthCheckService()) health->Shutdown();
  core_->Shutdown();
  core_->FlushJournal();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  logging::Get("coordinator")->info("stopped address={}", address_);
}

}  // namespace shardcoord::coordinator
