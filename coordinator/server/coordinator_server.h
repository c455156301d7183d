// CoordinatorServer: the coordinator as a running gRPC server. It owns the
// CoordinatorCore, the thin gRPC adapter (the rank Session streams on the completion-queue
// API, session_stream.h; every other method, queries and communicator calls, on callback
// reactors), the ticker thread that drives failure detection, the listener self-check and,
// when configured, the HTTP listener.
// Used by shardcoordd, by `shardctl replay` (embedded), by tests and by benchmarks.
//
// Thread-safety: Start, Shutdown and the accessors may be called from any thread.
#ifndef SHARDCOORD_COORDINATOR_SERVER_COORDINATOR_SERVER_H_
#define SHARDCOORD_COORDINATOR_SERVER_COORDINATOR_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/clock.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/server/ticker.h"
#include "coordinator/server/tls.h"
#include "coordinator/settings/options.h"

namespace grpc {
class Server;
}

namespace shardcoord::coordinator {

class CoordinatorService;
class HttpServer;
class SessionStreams;

// The service name the gRPC health service reports (besides "", the whole server).
inline constexpr char kHealthServiceName[] = "shardcoord.v1.Coordinator";

class CoordinatorServer {
 public:
  // Binds options.listen_address (port 0 picks a free port) and starts serving.
  // Errors: INVALID_ARGUMENT for bad options, UNAVAILABLE when the address cannot be bound,
  // and the TLS files', the token file's and the journal's own errors when they cannot be
  // loaded or opened (each names the file).
  // `on_listener_lost` is called (once, from a background thread) when the self-check finds
  // that the server no longer accepts connections (limits.self_check_interval); shardcoordd
  // exits then, so that its supervisor restarts it. Null: the loss is only logged.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      CoordinatorOptions options, std::shared_ptr<const Clock> clock = nullptr,
      std::function<void(const std::string& why)> on_listener_lost = nullptr);

  ~CoordinatorServer();  // Shuts down if still running.

  // "host:port" actually bound.
  const std::string& address() const { return address_; }
  // The HTTP listener's HOST:PORT (status page, /metrics, /healthz); empty when off.
  std::string http_address() const;
  HttpServer* http_for_testing() const { return http_.get(); }
  int port() const { return port_; }
  CoordinatorCore& core() { return *core_; }

  // Tells every session the coordinator is stopping, closes the streams and stops the
  // server, cancelling calls still running after `grace`. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(2));

 private:
  CoordinatorServer() = default;
  // Every self_check_interval: one query over a new connection to our own address. Three
  // failures in a row, over at least max(3 x interval, 10 s), mean the listener is gone (gRPC
  // 1.51 stops accepting for good after accept() fails with EMFILE): says so with the
  // descriptor count, calls on_listener_lost_. A check that took much longer than its
  // deadline (this process was paused) is not counted. Off under mutual TLS unless the
  // daemon's certificate is also a client certificate of the client CA.
  absl::Status Listen(const CoordinatorOptions& options);
  void StartSelfCheck(const CoordinatorOptions& options);
  void SelfCheckLoop();  // coordinator_server_self_check.cc

  std::unique_ptr<CoordinatorCore> core_;
  // With TLS: the checked copy of the certificate files that gRPC serves from (tls.h);
  // destroyed after server_. tls_ names what the listener and the self-check read.
  std::unique_ptr<TlsCopy> tls_copy_;
  TlsSettings tls_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<SessionStreams> sessions_;  // Destroyed after server_.
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  std::unique_ptr<Ticker> ticker_;  // The core's deadlines and pause detection.
  std::unique_ptr<HttpServer> http_;  // --http-listen; null when off.
  std::thread self_check_;
  std::function<void(const std::string&)> on_listener_lost_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SERVER_COORDINATOR_SERVER_H_
