// The daemon's HTTP listener (Boost.Beast; `--http-listen`, off by default, loopback unless
// the daemon is secured): GET / the status page (status_page.h), GET /metrics Prometheus
// text (metrics.h), GET /healthz "ok". With a token file, / and /metrics need a `read` (or
// admin) token, as `Authorization: Bearer TOKEN` (Prometheus' bearer_token) or Basic auth
// with the token as password (what a browser asks for); /healthz needs none. With TLS
// settings it serves HTTPS with the daemon's certificate, re-read when its files change.
//
// Bounded against slow, idle and hostile clients (DESIGN 14): asynchronous on two threads, so
// a connection that sends nothing holds no thread; one request per connection, the whole
// exchange (TLS handshake, request, response) within `http_request_timeout`; request line and
// headers at most 16 KiB (431), no body (GET and HEAD only: 405); at most
// `http_max_connections` open, further ones closed at once (a descriptor budget of its own, so
// the HTTP side cannot exhaust the gRPC listener's descriptors), at most
// `http_max_connections_per_client` from one address; at either limit the oldest connection
// still waiting for its request (of that address, for the second) makes room. The page and
// /metrics are made on a render thread of their own, one at a time: the I/O threads answer
// /healthz whatever the renders are doing (a 6 s /metrics once held it up behind it).
#ifndef SHARDCOORD_COORDINATOR_SERVER_HTTP_SERVER_H_
#define SHARDCOORD_COORDINATOR_SERVER_HTTP_SERVER_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/ops/status_page.h"
#include "coordinator/server/auth.h"

namespace shardcoord::coordinator {

class HttpServer {
 public:
  // Binds options.http_listen (port 0 picks one) and serves on its own threads.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(CoordinatorCore* core, const CoordinatorOptions& options,
                                                           Tokens tokens);
  ~HttpServer();  // Out of line: Io and TlsContexts are complete only in http_server.cc.
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  const std::string& address() const { return address_; }
  // Tests: runs `f` on the render thread, in turn with the pages (a render that takes long).
  void RunOnRenderThreadForTesting(std::function<void()> f);

 private:
  struct Io;  // The Beast/Asio parts (http_server.cc).
  class TlsContexts;
  template <class Stream>
  class Connection;
  // A connection that has not sent its request yet, which a new one may take the place of.
  class Waiting {
   public:
    virtual ~Waiting() = default;
    virtual bool awaiting_request() const = 0;
    virtual absl::Time accepted() const = 0;
    virtual const std::string& client() const = 0;  // The peer's address.
    virtual void Evict() = 0;  // Closes it (on its own strand).
  };
  // At the connection limit: closes the oldest connection still waiting for its request (of
  // `client` only, when not null), so that idle clients cannot keep /healthz (and every page)
  // from being answered. False: none.
  bool EvictOneWaiting(const std::string* client = nullptr);
  void AddWaiting(std::weak_ptr<Waiting> c);
  // Whether a new connection of `client` fits its per-client limit (making room if it can).
  bool AdmitClient(const std::string& client);
  void CountClient(const std::string& client, int delta);
  void WarnRefused(const char* why);
  struct Reply {
    int status = 200;
    std::string content_type, body;
    std::pair<std::string, std::string> header;  // One more header (name empty: none).
  };

  HttpServer() = default;
  void Accept();
  Reply Serve(const std::string& path, const std::string& authorization, const std::string& query = "");
  std::optional<Grant> Allowed(const std::string& authorization, const char* what) const;
  Snapshot Take(const std::string& job) const;  // "" : every job
  void SampleLoop();

  CoordinatorCore* core_ = nullptr;
  Tokens tokens_ = Tokens::None();
  int64_t heartbeat_interval_ms_ = 500;
  int max_connections_ = 64;
  int max_per_client_ = 16;
  std::chrono::milliseconds request_timeout_{5000};
  std::unique_ptr<TlsContexts> tls_;
  std::unique_ptr<Io> io_;
  std::atomic<int> open_{0};
  std::atomic<int64_t> refused_{0};
  std::string address_;
  std::vector<std::thread> threads_;
  std::thread sampler_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_refusal_log_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::deque<DecisionSample> history_ ABSL_GUARDED_BY(mu_);
  // Connections in the order they were accepted, while they may still be waiting (pruned).
  absl::Mutex waiting_mu_;
  std::deque<std::weak_ptr<Waiting>> waiting_ ABSL_GUARDED_BY(waiting_mu_);
  // Open connections by address. A mutex of its own: a connection's destructor counts itself
  // out, and the last reference to one can go while waiting_mu_ is held (EvictOneWaiting).
  absl::Mutex clients_mu_ ABSL_ACQUIRED_AFTER(waiting_mu_);
  std::map<std::string, int> per_client_ ABSL_GUARDED_BY(clients_mu_);
  std::atomic<int64_t> evicted_{0};
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SERVER_HTTP_SERVER_H_
