#include "coordinator/http_server.h"

#include <httplib.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/metrics.h"
#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {
namespace {

constexpr size_t kHistory = 300;                           // Chart points kept (10 min at 2 s).
constexpr absl::Duration kSampleInterval = absl::Seconds(2);

// "Basic base64(user:TOKEN)" -> "Bearer TOKEN"; anything else unchanged.
std::string AsBearer(const std::string& authorization) {
  if (authorization.rfind("Basic ", 0) != 0) return authorization;
  std::string decoded;
  if (!absl::Base64Unescape(authorization.substr(6), &decoded)) return "";
  const size_t colon = decoded.find(':');
  return colon == std::string::npos ? "" : "Bearer " + decoded.substr(colon + 1);
}

// Module decisions of every group, summed, now.
DecisionSample Totals(const v1::ListGroupsResponse& groups) {
  DecisionSample p;
  p.unix_ms = absl::ToUnixMillis(absl::Now());
  for (const auto& g : groups.groups()) {
    p.per_layer += g.counts().per_layer();
    p.skip += g.counts().skip();
    p.root += g.counts().root();
    p.replicate += g.counts().replicate();
  }
  return p;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(CoordinatorCore* core,
                                                               const CoordinatorOptions& options, Tokens tokens) {
  std::unique_ptr<HttpServer> s(new HttpServer);
  s->core_ = core;
  s->tokens_ = std::move(tokens);
  s->heartbeat_interval_ms_ = absl::ToInt64Milliseconds(options.heartbeat_interval);
  if (options.tls.enabled()) {
    s->server_ = std::make_unique<httplib::SSLServer>(options.tls.cert_file.c_str(), options.tls.key_file.c_str());
  } else {
    s->server_ = std::make_unique<httplib::Server>();
  }
  if (!s->server_->is_valid()) {
    return absl::InvalidArgumentError("HTTP listener: the TLS certificate or key cannot be used for HTTPS");
  }
  // Bounded: 4 threads, 5 s to read a request, 64 KiB bodies (no route takes one).
  s->server_->new_task_queue = [] { return new httplib::ThreadPool(4); };
  s->server_->set_read_timeout(5, 0);
  s->server_->set_write_timeout(5, 0);
  s->server_->set_payload_max_length(64 << 10);
  s->Routes();
  const std::string& listen = options.http_listen;
  const size_t colon = listen.rfind(':');
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("http_listen '", listen, "' must be HOST:PORT with a port in 0..65535"));
  }
  port = port == 0 ? s->server_->bind_to_any_port(host) : s->server_->bind_to_port(host, port) ? port : -1;
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for HTTP on ", listen,
                                               ": address in use or not local; pick another --http-listen HOST:PORT"));
  }
  s->address_ = absl::StrCat(listen.substr(0, colon), ":", port);
  s->listener_ = std::thread([srv = s->server_.get()] { srv->listen_after_bind(); });
  // stop() does nothing until the listener runs: wait for it, so that a server stopped at once
  // cannot leave its thread listening forever.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!s->server_->is_running() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  s->sampler_ = std::thread([p = s.get()] { p->SampleLoop(); });
  logging::Get("coordinator")->info("http serving address={} tls={}", s->address_, options.tls.enabled() ? "on" : "off");
  return s;
}

HttpServer::~HttpServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (server_) server_->stop();
  if (listener_.joinable()) listener_.join();
  if (sampler_.joinable()) sampler_.join();
}

std::optional<Grant> HttpServer::Allowed(const std::string& authorization, const char* what) const {
  auto grant = tokens_.Check(AsBearer(authorization), Role::kRead, what);
  if (!grant.ok()) return std::nullopt;
  return *grant;
}

Snapshot HttpServer::Take(const std::string& job) const {
  return Snapshot{core_->Status(job), core_->Groups(job), core_->Ranks(job), core_->Comms(job)};
}

void HttpServer::Routes() {
  // The caller's grant (a token limited to one job sees that job only), or a 401.
  auto guard = [this](const httplib::Request& req, httplib::Response& res, const char* what) {
    std::optional<Grant> grant = Allowed(req.get_header_value("Authorization"), what);
    if (grant) return grant;
    res.status = 401;
    res.set_header("WWW-Authenticate", "Basic realm=\"shardcoord (password: a read token)\"");
    res.set_content("a read token is required: Authorization: Bearer TOKEN, or Basic auth with it as password\n",
                    "text/plain");
    return grant;
  };
  server_->Get("/healthz", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
  server_->Get("/metrics", [this, guard](const httplib::Request& req, httplib::Response& res) {
    auto grant = guard(req, res, "GET /metrics");
    if (!grant) return;
    res.set_content(MetricsText(Take(grant->job)), "text/plain; version=0.0.4; charset=utf-8");
  });
  server_->Get("/", [this, guard](const httplib::Request& req, httplib::Response& res) {
    auto grant = guard(req, res, "GET /");
    if (!grant) return;
    PageInput in;
    in.snapshot = Take(grant->job);
    in.events = core_->Events(grant->job, 0, 20);
    std::reverse(in.events.begin(), in.events.end());
    in.heartbeat_interval_ms = heartbeat_interval_ms_;
    if (grant->job.empty()) {  // The chart sums every job: only for callers who may see them all.
      absl::MutexLock lock(&mu_);
      in.history = history_;
    }
    in.history.push_back(Totals(in.snapshot.groups));  // The chart ends now.
    res.set_content(StatusPage(in), "text/html; charset=utf-8");
  });
  server_->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (res.status == 404) res.set_content("no such page; try /, /metrics or /healthz\n", "text/plain");
  });
}

void HttpServer::SampleLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.Unlock();
    const DecisionSample p = Totals(core_->Groups(""));
    mu_.Lock();
    history_.push_back(p);
    if (history_.size() > kHistory) history_.pop_front();
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), kSampleInterval);
  }
}

}  // namespace shardcoord::coordinator
