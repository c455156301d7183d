// The gRPC side of the daemon: the rank streams on completion queues (session_stream.h: a
// SessionCall per stream feeding CoordinatorCore, a bounded outbox per session), the other
// methods on callback reactors, converting at the edge (wire_intake.h), the tick and
// self-check threads (threads and locks: DESIGN 9).
#include "coordinator/server/coordinator_server.h"

#include "coordinator/server/auth.h"
#include "coordinator/server/http_server.h"
#include "coordinator/server/session_stream.h"
#include "coordinator/server/tls.h"
#include "coordinator/server/wire_intake.h"

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

constexpr int kMaxEventsPerQuery = 10000;

// The gRPC adapter: converts calls into CoordinatorCore calls after checking the caller's
// token (auth.h). No logic of its own.
class CoordinatorService final : public CoordinatorServiceBase {
 public:
  CoordinatorService(CoordinatorCore* core, Tokens tokens) : core_(core), tokens_(std::move(tokens)) {}

  // Whether a Session stream may open (SessionStreams): the job its token is for, "" for any.
  absl::StatusOr<std::string> AuthorizeSession(grpc::ServerContextBase* ctx) const {
    auto grant = Authorize(ctx, Role::kRank, "Session");
    if (!grant.ok()) return grant.status();
    return grant->job;
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
    core_->CommJoin(FromWire(*req), [r, resp](absl::StatusOr<CommMembership> result) {
      if (result.ok()) *resp = ToWire(*result);
      r->Finish(ToGrpcStatus(result.status()));
    });
    return r;
  }
  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* ctx, const v1::StoreSetRequest* req,
                                     v1::StoreSetResponse* resp) override {
    if (grpc::Status st = AuthorizeRank(ctx, req->job_id(), "StoreSet"); !st.ok()) return Refuse(ctx, st);
    auto* r = ctx->DefaultReactor();
    r->Finish(ToGrpcStatus(core_->StoreSet(FromWire(*req))));
    return r;
  }
  grpc::ServerUnaryReactor* StoreGet(grpc::CallbackServerContext* ctx, const v1::StoreGetRequest* req,
                                     v1::StoreGetResponse* resp) override {
    if (grpc::Status st = AuthorizeRank(ctx, req->job_id(), "StoreGet"); !st.ok()) return Refuse(ctx, st);
    auto* r = ctx->DefaultReactor();
    core_->StoreGet(FromWire(*req), [r, resp](absl::StatusOr<std::vector<std::string>> result) {
      if (result.ok()) *resp = ToWire(*result);
      r->Finish(ToGrpcStatus(result.status()));
    });
    return r;
  }
  grpc::ServerUnaryReactor* CommReport(grpc::CallbackServerContext* ctx, const v1::CommReportRequest* req,
                                       v1::CommReportResponse* resp) override {
    if (grpc::Status st = AuthorizeRank(ctx, req->job_id(), "CommReport"); !st.ok()) return Refuse(ctx, st);
    auto* r = ctx->DefaultReactor();
    r->Finish(ToGrpcStatus(core_->CommReport(FromWire(*req))));
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
  absl::StatusOr<Grant> Authorize(grpc::ServerContextBase* ctx, Role role, const char* method) const {
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
};

// Builds and starts the gRPC server on options.listen_address (port 0 picks one).
absl::Status CoordinatorServer::Listen(const CoordinatorOptions& options) {
  // grpc.health.v1.Health (built into gRPC; no token needed, it tells nothing but SERVING /
  // NOT_SERVING): for load balancers, Kubernetes gRPC probes and grpc_health_probe.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, ServerCredentialsFor(tls_), &port_);
  builder.RegisterService(service_.get());
  const int threads = options.session_threads > 0 ? options.session_threads
                                                  : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  sessions_ = std::make_unique<SessionStreams>(
      core_.get(), service_.get(),
      [service = service_.get()](grpc::ServerContextBase* ctx) { return service->AuthorizeSession(ctx); }, threads,
      builder);
  // Workers send keepalive pings to notice a lost coordinator; let them.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // A second daemon on the same port must fail, not share the port and split the job.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  // Connections that never speak HTTP/2 (idle or hostile) hold a descriptor only this long.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(options.limits.handshake_timeout)));
  server_ = builder.BuildAndStart();
  if (server_ && port_ != 0) {
    if (absl::Status s = sessions_->Start(); !s.ok()) {
      server_->Shutdown(std::chrono::system_clock::now());
      server_->Wait();
      sessions_->Stop();
      server_.reset();  // Never served: Shutdown() has nothing left to stop.
      return s;
    }
  }
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
  server->tls_ = options.tls;
  if (options.tls.enabled()) {
    auto files = TlsCopy::Start(options.tls);
    if (!files.ok()) return files.status();
    server->tls_copy_ = std::move(*files);
    server->tls_ = server->tls_copy_->served();
  }
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
  const char* tls = !options.tls.enabled() ? "off" : options.tls.mutual() ? "mutual" : "on";
  logging::Get("coordinator")
      ->info("serving address={} tls={} tokens={}", server->address_, tls, tokens_enabled ? "on" : "off");
  server->core_->RecordDaemonEvent(
      true, absl::StrCat("serving ", server->address_, " (tls ", tls, ", tokens ", tokens_enabled ? "on" : "off", ")"));
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
  core_->RecordDaemonEvent(false, absl::StrCat("stopping; serving ", address_, " until now"));
  core_->Shutdown();
  core_->FlushJournal();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  sessions_->Stop();
  logging::Get("coordinator")->info("stopped address={}", address_);
}

}  // namespace shardcoord::coordinator
