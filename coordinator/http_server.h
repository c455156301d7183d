// The daemon's HTTP listener (cpp-httplib; `--http-listen`, off by default, loopback unless
// the daemon is secured): GET / the status page (status_page.h), GET /metrics Prometheus
// text (metrics.h), GET /healthz "ok". With a token file, / and /metrics need a `read` (or
// admin) token, as `Authorization: Bearer TOKEN` (Prometheus' bearer_token) or Basic auth
// with the token as password (what a browser asks for); /healthz needs none. With TLS
// settings it serves HTTPS with the daemon's certificate (read at start).
#ifndef SHARDCOORD_COORDINATOR_HTTP_SERVER_H_
#define SHARDCOORD_COORDINATOR_HTTP_SERVER_H_

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/status_page.h"

namespace httplib {
class Server;
}

namespace shardcoord::coordinator {

class HttpServer {
 public:
  // Binds options.http_listen (port 0 picks one) and serves on its own threads.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(CoordinatorCore* core, const CoordinatorOptions& options,
                                                           Tokens tokens);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  const std::string& address() const { return address_; }

 private:
  HttpServer() = default;
  void Routes();
  std::optional<Grant> Allowed(const std::string& authorization, const char* what) const;
  Snapshot Take(const std::string& job) const;  // "" : every job
  void SampleLoop();

  CoordinatorCore* core_ = nullptr;
  Tokens tokens_ = Tokens::None();
  int64_t heartbeat_interval_ms_ = 500;
  std::unique_ptr<httplib::Server> server_;
  std::string address_;
  std::thread listener_, sampler_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<DecisionSample> history_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_HTTP_SERVER_H_
