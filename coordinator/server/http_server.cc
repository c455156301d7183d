#include "coordinator/server/http_server.h"

#include <sys/stat.h>

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <functional>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/ops/metrics.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {

namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
using tcp = boost::asio::ip::tcp;

namespace {

constexpr size_t kHistory = 300;                           // Chart points kept (10 min at 2 s).
constexpr absl::Duration kSampleInterval = absl::Seconds(2);
constexpr uint32_t kHeaderLimit = 16 << 10;                // Request line and headers, all together.
constexpr int kIoThreads = 2;
constexpr absl::Duration kEvictableAge = absl::Milliseconds(200);  // See EvictOneWaiting.

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
    for (size_t k = 0; k < kNumDecisions; ++k) p.by_kind[k] += CountOf(g.counts(), kDecisions[k]);
  }
  return p;
}

int64_t MtimeNs(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

// The HTTPS certificate and key, re-read when their files change (checked at most every
// reload interval, at a new connection). A pair that does not load (a renewal caught between
// writing the certificate and the key) keeps the previous one in service, with a warning.
class HttpServer::TlsContexts {
 public:
  explicit TlsContexts(const TlsSettings& tls) : tls_(tls) {}

  absl::Status Load() {
    auto ctx = Build();
    if (!ctx.ok()) return ctx.status();
    absl::MutexLock lock(&mu_);
    current_ = *std::move(ctx);
    stamp_ = Stamp();
    checked_ = absl::Now();
    return absl::OkStatus();
  }

  std::shared_ptr<ssl::context> Current() {
    absl::MutexLock lock(&mu_);
    if (absl::Now() - checked_ >= tls_.reload_interval) {
      checked_ = absl::Now();
      const auto stamp = Stamp();
      if (stamp != stamp_) {
        auto ctx = Build();
        if (ctx.ok()) {
          current_ = *std::move(ctx);
          stamp_ = stamp;
          logging::Get("coordinator")->info("http: TLS certificate and key reloaded from {}", tls_.cert_file);
        } else {
          logging::Get("coordinator")->warn("http: keeping the previous TLS certificate: {} (retried in {} s)",
                                            std::string(ctx.status().message()), absl::ToInt64Seconds(tls_.reload_interval));
        }
      }
    }
    return current_;
  }

 private:
  std::pair<int64_t, int64_t> Stamp() const { return {MtimeNs(tls_.cert_file), MtimeNs(tls_.key_file)}; }

  absl::StatusOr<std::shared_ptr<ssl::context>> Build() const {
    auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
    ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                     ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
    beast::error_code ec;
    ctx->use_certificate_chain_file(tls_.cert_file, ec);
    if (!ec) ctx->use_private_key_file(tls_.key_file, ssl::context::pem, ec);
    if (!ec && SSL_CTX_check_private_key(ctx->native_handle()) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("HTTPS: the key ", tls_.key_file, " does not match the certificate ",
                                                     tls_.cert_file));
    }
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat("HTTPS: the certificate ", tls_.cert_file, " or key ",
                                                     tls_.key_file, " cannot be used: ", ec.message()));
    }
    return ctx;
  }

  const TlsSettings tls_;
  absl::Mutex mu_;
  std::shared_ptr<ssl::context> current_ ABSL_GUARDED_BY(mu_);
  std::pair<int64_t, int64_t> stamp_ ABSL_GUARDED_BY(mu_);
  absl::Time checked_ ABSL_GUARDED_BY(mu_);
};

struct HttpServer::Io {
  net::io_context context{kIoThreads};
  tcp::acceptor acceptor{net::make_strand(context)};
  // The page and /metrics are made here, one at a time, never on the I/O threads.
  net::thread_pool render{1};
  ~Io() {
    beast::error_code ignored;
    acceptor.close(ignored);
  }
};

// One connection: (TLS handshake,) one request, one response, close; the whole exchange under
// the request deadline, so a slow or silent client costs a descriptor and a little memory
// until then, never a thread.
template <class Stream>
class HttpServer::Connection : public HttpServer::Waiting, public std::enable_shared_from_this<Connection<Stream>> {
 public:
  Connection(HttpServer* server, tcp::socket socket, std::shared_ptr<ssl::context> ctx, std::string client)
      : server_(server), ctx_(std::move(ctx)), stream_(MakeStream(std::move(socket), ctx_.get())),
        client_(std::move(client)) {
    server_->open_.fetch_add(1);
    server_->CountClient(client_, 1);
  }
  ~Connection() override {
    server_->CountClient(client_, -1);
    server_->open_.fetch_sub(1);
  }

  bool awaiting_request() const override { return awaiting_.load(); }
  absl::Time accepted() const override { return accepted_; }
  const std::string& client() const override { return client_; }
  void Evict() override {
    net::post(stream_.get_executor(), [self = this->shared_from_this()] {
      if (!self->awaiting_.load()) return;  // Its request came meanwhile: it is answered.
      beast::error_code ignored;
      beast::get_lowest_layer(self->stream_).socket().close(ignored);  // Its pending read ends: it goes.
    });
  }

  void Start() {
    server_->AddWaiting(this->shared_from_this());
    beast::get_lowest_layer(stream_).expires_after(server_->request_timeout_);
    if constexpr (std::is_same_v<Stream, beast::tcp_stream>) {
      Read();
    } else {
      stream_.async_handshake(ssl::stream_base::server,
                              [self = this->shared_from_this()](beast::error_code ec) {
                                if (!ec) self->Read();
                              });
    }
  }

 private:
  void Read() {
    parser_.header_limit(kHeaderLimit);
    parser_.body_limit(64 << 10);
    http::async_read_header(stream_, buffer_, parser_,
                            [self = this->shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  void OnHeader(beast::error_code ec) {
    awaiting_.store(false);
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
      return Write(Response(11, {431, "text/plain",
                                 absl::StrCat("the request line and headers exceed ", kHeaderLimit, " bytes\n"), {}}));
    }
    if (ec == http::error::body_limit) {  // A GET or HEAD has no body; a big one is refused before it is read.
      return Write(Response(11, {413, "text/plain", "a request body is not taken: only GET and HEAD\n", {}}));
    }
    if (ec && ec.category() == beast::error_code(http::error::bad_target).category() &&
        ec != http::error::end_of_stream &&
        ec != http::error::partial_message) {
      // Bytes that are no HTTP request (bad framing, a bad method or version): said, not just closed.
      return Write(Response(11, {400, "text/plain", absl::StrCat("malformed HTTP request: ", ec.message(), "\n"), {}}));
    }
    if (ec) return;  // Timed out, closed or cut short: nothing to answer.
    const auto& req = parser_.get();
    if (req.method() != http::verb::get && req.method() != http::verb::head) {
      return Write(Response(req.version(), {405, "text/plain", "only GET and HEAD\n", {"Allow", "GET, HEAD"}}));
    }
    std::string target(req.target());
    const size_t question = target.find('?');
    std::string path = target.substr(0, question);
    std::string query = question == std::string::npos ? "" : target.substr(question + 1);
    std::string authorization(req[http::field::authorization]);
    const bool head = req.method() == http::verb::head;
    const unsigned version = req.version();
    if (path != "/" && path != "/metrics") {  // /healthz, 404: answered here, at once.
      return Answer(version, head, server_->Serve(path, authorization, query));
    }
    // A page: made on the render thread, so that however long it takes (or however many wait
    // for it) the I/O threads go on answering /healthz. One whose client is cut by the time its
    // turn comes is not made.
    const absl::Time deadline = absl::Now() + absl::FromChrono(server_->request_timeout_);
    net::post(server_->io_->render, [self = this->shared_from_this(), path = std::move(path),
                                     query = std::move(query), authorization = std::move(authorization), head,
                                     version, deadline] {
      if (absl::Now() > deadline) return;
      Reply reply = self->server_->Serve(path, authorization, query);
      net::post(self->stream_.get_executor(), [self, head, version, reply = std::move(reply)]() mutable {
        self->Answer(version, head, std::move(reply));
      });
    });
  }

  void Answer(unsigned version, bool head, Reply reply) {
    auto res = Response(version, std::move(reply));
    if (head) {
      const auto length = res.body().size();
      res.body().clear();
      res.content_length(length);
    }
    Write(std::move(res));
  }

  // Every answer: one request per connection, so each says it closes.
  static http::response<http::string_body> Response(unsigned version, Reply reply) {
    http::response<http::string_body> res{static_cast<http::status>(reply.status), version};
    res.set(http::field::content_type, reply.content_type);
    if (!reply.header.first.empty()) res.set(reply.header.first, reply.header.second);
    res.body() = std::move(reply.body);
    res.keep_alive(false);
    res.prepare_payload();
    return res;
  }

  void Write(http::response<http::string_body> res) {
    response_ = std::move(res);
    beast::get_lowest_layer(stream_).expires_after(server_->request_timeout_);
    http::async_write(stream_, response_, [self = this->shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return;
      if constexpr (std::is_same_v<Stream, beast::tcp_stream>) {
        beast::error_code ignored;
        self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
      } else {
        self->stream_.async_shutdown([self](beast::error_code) {});
      }
    });
  }

  static Stream MakeStream(tcp::socket socket, ssl::context* ctx) {
    if constexpr (std::is_same_v<Stream, beast::tcp_stream>) {
      return beast::tcp_stream(std::move(socket));
    } else {
      return Stream(beast::tcp_stream(std::move(socket)), *ctx);
    }
  }

  HttpServer* server_;
  std::shared_ptr<ssl::context> ctx_;  // Outlives stream_ (TLS): a reload may replace the server's.
  Stream stream_;
  beast::flat_buffer buffer_;  // Grows to the header limit at most (the parser stops there).
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> response_;
  const std::string client_;
  std::atomic<bool> awaiting_{true};  // No request header yet.
  const absl::Time accepted_ = absl::Now();
};

void HttpServer::AddWaiting(std::weak_ptr<Waiting> c) {
  absl::MutexLock lock(&waiting_mu_);
  if (waiting_.size() >= 2 * static_cast<size_t>(max_connections_) + 16) {  // Bounded: drop those gone or served.
    std::deque<std::weak_ptr<Waiting>> kept;
    for (auto& w : waiting_) {
      auto p = w.lock();
      if (p && p->awaiting_request()) kept.push_back(std::move(w));
    }
    waiting_.swap(kept);
  }
  waiting_.push_back(std::move(c));
}

bool HttpServer::EvictOneWaiting(const std::string* client) {
  // Only one that has had time to send its request (a TLS handshake included): a burst of new
  // connections does not push out clients that are about to speak; the newcomer is refused then.
  const absl::Time young = absl::Now() - kEvictableAge;
  absl::MutexLock lock(&waiting_mu_);
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    std::shared_ptr<Waiting> c = it->lock();
    if (!c || !c->awaiting_request()) {  // Gone or served: pruned on the way.
      it = waiting_.erase(it);
      continue;
    }
    if (c->accepted() > young) return false;  // In accept order: the rest are younger still.
    if (client != nullptr && c->client() != *client) {
      ++it;
      continue;
    }
    waiting_.erase(it);
    c->Evict();
    ++evicted_;
    return true;
  }
  return false;
}

void HttpServer::RunOnRenderThreadForTesting(std::function<void()> f) { net::post(io_->render, std::move(f)); }

bool HttpServer::AdmitClient(const std::string& client) {
  {
    absl::MutexLock lock(&clients_mu_);
    auto it = per_client_.find(client);
    if (it == per_client_.end() || it->second < max_per_client_) return true;
  }
  return EvictOneWaiting(&client);
}

void HttpServer::CountClient(const std::string& client, int delta) {
  absl::MutexLock lock(&clients_mu_);
  int& n = per_client_[client];
  n += delta;
  if (n <= 0) per_client_.erase(client);
}

void HttpServer::WarnRefused(const char* why) {
  const int64_t refused = ++refused_;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  if (now - last_refusal_log_ < absl::Seconds(10)) return;
  last_refusal_log_ = now;
  logging::Get("coordinator")->warn("http: a new connection refused: {}; refused {} so far", why, refused);
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(CoordinatorCore* core,
                                                               const CoordinatorOptions& options, Tokens tokens) {
  std::unique_ptr<HttpServer> s(new HttpServer);
  s->core_ = core;
  s->tokens_ = std::move(tokens);
  s->heartbeat_interval_ms_ = absl::ToInt64Milliseconds(options.heartbeat_interval);
  s->max_connections_ = options.http_max_connections;
  s->max_per_client_ = options.http_max_connections_per_client;
  s->request_timeout_ = std::chrono::milliseconds(absl::ToInt64Milliseconds(options.http_request_timeout));
  if (options.tls.enabled()) {
    s->tls_ = std::make_unique<TlsContexts>(options.tls);
    if (absl::Status st = s->tls_->Load(); !st.ok()) return st;
  }
  const std::string& listen = options.http_listen;
  const size_t colon = listen.rfind(':');
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("http_listen '", listen, "' must be HOST:PORT with a port in 0..65535"));
  }
  if (host == "localhost") host = "127.0.0.1";
  beast::error_code ec;
  const auto address = net::ip::make_address(host.empty() ? "0.0.0.0" : host, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("http_listen '", listen, "': '", host,
                                                   "' is not an IP address (or localhost)"));
  }
  s->io_ = std::make_unique<Io>();
  auto& acceptor = s->io_->acceptor;
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(port));
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot listen for HTTP on ", listen, ": ", ec.message(),
                                               "; pick another --http-listen HOST:PORT"));
  }
  s->address_ = absl::StrCat(listen.substr(0, colon), ":", acceptor.local_endpoint().port());
  s->Accept();
  for (int i = 0; i < kIoThreads; ++i) s->threads_.emplace_back([io = &s->io_->context] { io->run(); });
  s->sampler_ = std::thread([p = s.get()] { p->SampleLoop(); });
  logging::Get("coordinator")->info("http serving address={} tls={} max_connections={} request_timeout_ms={}",
                                    s->address_, options.tls.enabled() ? "on" : "off", s->max_connections_,
                                    s->request_timeout_.count());
  return s;
}

HttpServer::~HttpServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (io_) io_->context.stop();
  for (auto& t : threads_) t.join();
  if (io_) {  // A render still running finishes; those queued are dropped.
    io_->render.stop();
    io_->render.join();
  }
  if (sampler_.joinable()) sampler_.join();
  io_.reset();  // Closes the listener and destroys the connections still pending, closing their sockets.
}

void HttpServer::Accept() {
  io_->acceptor.async_accept(net::make_strand(io_->context), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted) return;
    if (!ec) {
      beast::error_code peer_ec;
      const auto peer = socket.remote_endpoint(peer_ec);
      std::string client = peer_ec ? std::string("?") : peer.address().to_string();
      // At a limit, the oldest connection that has sent no request yet makes room (the
      // client's own, at its limit): idle or slow clients cannot keep /healthz from being
      // answered (64 reopened idle connections did). Refused at once otherwise: the
      // descriptor is freed now, not held until a deadline.
      const char* refused = nullptr;
      if (!AdmitClient(client)) {
        refused = "its address holds http_max_connections_per_client connections, each with its request read";
      } else if (open_.load() >= max_connections_ && !EvictOneWaiting()) {
        refused = "http_max_connections connections are open, each with its request read";
      }
      if (refused != nullptr) {
        beast::error_code ignored;
        socket.close(ignored);
        WarnRefused(refused);
      } else if (tls_) {
        std::make_shared<Connection<beast::ssl_stream<beast::tcp_stream>>>(this, std::move(socket), tls_->Current(),
                                                                           std::move(client))
            ->Start();
      } else {
        std::make_shared<Connection<beast::tcp_stream>>(this, std::move(socket), nullptr, std::move(client))->Start();
      }
    } else {
      // EMFILE and the like: the gRPC listener's self-check owns the verdict on descriptors;
      // here, wait a little instead of spinning.
      logging::Get("coordinator")->warn("http: accept failed: {}", ec.message());
      absl::SleepFor(absl::Milliseconds(100));
    }
    Accept();
  });
}

std::optional<Grant> HttpServer::Allowed(const std::string& authorization, const char* what) const {
  auto grant = tokens_.Check(AsBearer(authorization), Role::kRead, what);
  if (!grant.ok()) return std::nullopt;
  return *grant;
}

Snapshot HttpServer::Take(const std::string& job) const {
  Snapshot s{core_->Status(job), core_->Groups(job), core_->Ranks(job), core_->Comms(job)};
  s.rank_series_max = core_->options().metrics_rank_series_max;
  s.labels_max = core_->options().metrics_labels_max;
  if (!job.empty()) return s;  // A reader of one job sees nothing daemon-wide.
  s.daemon = &core_->metrics();
  s.buffered_bytes = core_->buffers()->used();
  s.buffered_bytes_limit = core_->buffers()->limit();
  s.process = true;
  return s;
}

namespace {

// The value of `key` in a query string (`a=1&job=x`), URL-decoded; "" when absent.
std::string QueryValue(const std::string& query, const std::string& key) {
  for (absl::string_view pair : absl::StrSplit(query, '&')) {
    if (absl::StartsWith(pair, key + "=")) return UrlDecode(std::string(pair.substr(key.size() + 1)));
  }
  return "";
}

}  // namespace

HttpServer::Reply HttpServer::Serve(const std::string& path, const std::string& authorization,
                                    const std::string& query) {
  if (path == "/healthz") return {200, "text/plain", "ok\n", {}};
  if (path != "/metrics" && path != "/") return {404, "text/plain", "no such page; try /, /metrics or /healthz\n", {}};
  std::optional<Grant> grant = Allowed(authorization, path == "/" ? "GET /" : "GET /metrics");
  if (!grant) {
    return {401, "text/plain", "a read token is required: Authorization: Bearer TOKEN, or Basic auth with it as password\n",
            {"WWW-Authenticate", "Basic realm=\"shardcoord (password: a read token)\""}};
  }
  if (path == "/metrics") return {200, "text/plain; version=0.0.4; charset=utf-8", MetricsText(Take(grant->job)), {}};
  PageInput in;
  // /?job=ID: that job's page. A reader limited to one job sees that one whatever it asks.
  in.job = grant->job.empty() ? QueryValue(query, "job") : grant->job;
  if (std::string bad = ControlCharacterIn(in.job); !bad.empty()) {  // /?job=%00 was put in the page.
    return {400, "text/plain", absl::StrCat("the job in ?job= is no job id: ", bad, "\n"), {}};
  }
  in.link_every_job = grant->job.empty();
  in.snapshot = Take(in.job);
  in.events = core_->Events(in.job, 0, 20);
  std::reverse(in.events.begin(), in.events.end());
  in.heartbeat_interval_ms = heartbeat_interval_ms_;
  if (in.job.empty()) {  // The chart sums every job: only on the page of every job.
    absl::MutexLock lock(&mu_);
    in.history = history_;
  }
  in.history.push_back(Totals(in.snapshot.groups));  // The chart ends now.
  return {200, "text/html; charset=utf-8", StatusPage(in), {}};
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
