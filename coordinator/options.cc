#include "coordinator/options.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/auth.h"
#include "absl/strings/str_join.h"
#include "coordinator/resume_auth.h"

namespace shardcoord::coordinator {

namespace {

absl::Status ValidateListen(const CoordinatorOptions& o) {
  {
    const std::string& a = o.listen_address;
    const size_t colon = a.rfind(':');
    int port = -1;
    const bool ok = colon != std::string::npos && colon > 0 &&
                    absl::SimpleAtoi(a.substr(colon + 1), &port) && port >= 0 && port <= 65535 &&
                    a.substr(colon + 1).find_first_not_of("0123456789") == std::string::npos;
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "listen address '", a, "' is not HOST:PORT with a port in 0..65535 (e.g. 127.0.0.1:7871, "
          "0.0.0.0:7871, [::]:7871; port 0 picks a free one)"));
    }
  }
  return absl::OkStatus();
}

// Every duration at most 24 h and > 0 where zero makes no sense; the heartbeat timeout at
// least twice the interval.
absl::Status ValidateDurations(const CoordinatorOptions& o) {
  for (const auto& [name, d] : std::vector<std::pair<const char*, absl::Duration>>{
           {"heartbeat interval", o.heartbeat_interval},
           {"heartbeat timeout", o.heartbeat_timeout},
           {"plan timeout", o.plan_timeout},
           {"behind threshold", o.behind_threshold},
           {"recovery window", o.recovery_window},
           {"job retention", o.limits.job_retention},
           {"handshake timeout", o.limits.handshake_timeout},
           {"self-check interval", o.limits.self_check_interval}}) {
    if (d > kMaxDuration) {
      return absl::InvalidArgumentError(absl::StrCat(name, " (", absl::ToInt64Milliseconds(d),
                                                     " ms) must be at most 24 h (86400000 ms)"));
    }
  }
  // Below these the daemon's own scheduling jitter (the ticker runs every few ms) is as long
  // as the timeout: silent ranks were never declared dead and pause events flooded the log.
  if (o.heartbeat_interval < kMinHeartbeatInterval) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat interval (", absl::ToInt64Milliseconds(o.heartbeat_interval),
                                                   " ms) must be at least ",
                                                   absl::ToInt64Milliseconds(kMinHeartbeatInterval), " ms"));
  }
  if (o.heartbeat_timeout < kMinHeartbeatTimeout) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat timeout (", absl::ToInt64Milliseconds(o.heartbeat_timeout),
                                                   " ms) must be at least ",
                                                   absl::ToInt64Milliseconds(kMinHeartbeatTimeout), " ms"));
  }
  if (o.heartbeat_timeout < 2 * o.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat timeout (", absl::ToInt64Milliseconds(o.heartbeat_timeout),
        " ms) must be at least twice the heartbeat interval (",
        absl::ToInt64Milliseconds(o.heartbeat_interval), " ms)"));
  }
  if (o.plan_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("plan timeout must be > 0 ms");
  }
  if (o.behind_threshold <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("behind threshold must be > 0 ms");
  }
  if (o.recovery_window <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("recovery window must be > 0 ms");
  }
  return absl::OkStatus();
}

// Counts and limits: each >= 1, the promotion thresholds consistent.
absl::Status ValidateCounts(const CoordinatorOptions& o) {
  if (o.max_lookahead < 1) return absl::InvalidArgumentError("max lookahead must be >= 1");
  if (o.promotion.window < 1 || o.promotion.promote_threshold < 1 ||
      o.promotion.promote_threshold > o.promotion.window ||
      o.promotion.demote_threshold < 0 ||
      o.promotion.demote_threshold >= o.promotion.promote_threshold) {
    return absl::InvalidArgumentError(
        "promotion settings need 1 <= promote_threshold <= promote_window and "
        "0 <= demote_threshold < promote_threshold");
  }
  if (o.event_capacity < 1 || o.decision_history < 1) {
    return absl::InvalidArgumentError("event_capacity and decision_history must be >= 1");
  }
  const CoordinatorLimits& l = o.limits;
  for (const auto& [name, v] : std::vector<std::pair<const char*, int64_t>>{
           {"max_world_size", l.max_world_size},
           {"max_total_ranks", l.max_total_ranks},
           {"max_jobs", l.max_jobs},
           {"max_modules", l.max_modules},
           {"max_units_per_module", l.max_units_per_module},
           {"max_name_bytes", l.max_name_bytes},
           {"max_pending_microbatches", l.max_pending_microbatches},
           {"max_communicators_per_job", l.max_communicators_per_job},
           {"max_store_value_bytes", l.max_store_value_bytes},
           {"max_outbox_bytes", l.max_outbox_bytes},
           {"max_buffered_bytes", l.max_buffered_bytes}}) {
    if (v < 1) return absl::InvalidArgumentError(absl::StrCat(name, " must be >= 1, got ", v));
  }
  if (l.max_outbox_bytes < (64 << 10)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_outbox_bytes must be >= 65536 (one decision batch must fit), got ", l.max_outbox_bytes));
  }
  if (l.max_buffered_bytes < (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_buffered_bytes must be >= 1048576 (the daemon's buffers for all clients together), got ",
        l.max_buffered_bytes));
  }
  if (l.job_retention < absl::ZeroDuration() || l.self_check_interval < absl::ZeroDuration() ||
      l.handshake_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "job retention and self-check interval must be >= 0 ms, handshake timeout > 0 ms");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOptions(const CoordinatorOptions& o) {
  if (o.session_threads < 0 || o.session_threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("session_threads must be in 0..1024 (0: one per core), got ",
                                                   o.session_threads));
  }
  if (absl::Status s = ValidateListen(o); !s.ok()) return s;
  if (!o.insecure && !IsLoopbackAddress(o.listen_address) && (o.token_file.empty() || !o.tls.enabled())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address ", o.listen_address, " is not loopback, and without ",
        o.token_file.empty() ? "a token file anyone who reaches it can act for any rank"
                             : "TLS the tokens travel in clear text",
        ": give --token-file and --tls-cert/--tls-key (see README, Security), or --insecure to accept that"));
  }
  if (!o.http_listen.empty()) {
    if (o.http_listen.rfind(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("http_listen '", o.http_listen, "' must be HOST:PORT"));
    }
    if (!o.insecure && !IsLoopbackAddress(o.http_listen) && (o.token_file.empty() || !o.tls.enabled())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "http_listen ", o.http_listen, " is not loopback: give --token-file and --tls-cert/--tls-key (the page and "
          "/metrics then need a read token, over HTTPS), or --insecure to accept that"));
    }
  }
  if (o.http_max_connections < 1 || o.http_max_connections > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("http_max_connections must be in 1..65536, got ",
                                                   o.http_max_connections));
  }
  if (o.metrics_rank_series_max < 0 || o.metrics_rank_series_max > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("metrics_rank_series_max must be in 0..65536, got ",
                                                   o.metrics_rank_series_max));
  }
  if (o.http_request_timeout < absl::Milliseconds(100) || o.http_request_timeout > absl::Minutes(10)) {
    return absl::InvalidArgumentError(absl::StrCat("http_request_timeout_ms must be in 100..600000, got ",
                                                   absl::ToInt64Milliseconds(o.http_request_timeout)));
  }
  if (o.journal_retention < absl::Hours(1) || o.journal_max_events < 1) {
    return absl::InvalidArgumentError(absl::StrCat("journal_retention_hours must be >= 1 and journal_max_events >= 1, got ",
                                                   absl::ToInt64Hours(o.journal_retention), " and ",
                                                   o.journal_max_events));
  }
  if (o.default_policy == Policy::kUnspecified) {
    return absl::InvalidArgumentError("default policy must be auto, per_layer, root or replicate");
  }
  if (o.default_fallback == Fallback::kUnspecified) {
    return absl::InvalidArgumentError("default fallback must be root or replicate");
  }
  if (absl::Status s = ValidateDurations(o); !s.ok()) return s;
  return ValidateCounts(o);
}

namespace {

// One key of the config file into the options (the key is known). Throws YAML::Exception on
// a value of the wrong type.
absl::Status ApplyConfigKey(const std::string& path, const std::string& key, const YAML::Node& v,
                            CoordinatorOptions& o) {
  if (key == "listen") o.listen_address = v.as<std::string>();
  if (key == "default_policy") {
    auto p = ParsePolicy(v.as<std::string>());
    if (!p) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config file ", path, ": default_policy '", v.as<std::string>(),
          "' is not one of auto, per_layer, root, replicate"));
    }
    o.default_policy = *p;
  }
  if (key == "default_fallback") {
    auto f = ParseFallback(v.as<std::string>());
    if (!f) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path,
                                                     ": default_fallback '",
                                                     v.as<std::string>(),
                                                     "' is not one of root, replicate"));
    }
    o.default_fallback = *f;
  }
  if (key == "heartbeat_interval_ms") o.heartbeat_interval = absl::Milliseconds(v.as<int64_t>());
  if (key == "heartbeat_timeout_ms") o.heartbeat_timeout = absl::Milliseconds(v.as<int64_t>());
  if (key == "plan_timeout_ms") o.plan_timeout = absl::Milliseconds(v.as<int64_t>());
  if (key == "max_lookahead") o.max_lookahead = v.as<int>();
  if (key == "behind_threshold_ms") o.behind_threshold = absl::Milliseconds(v.as<int64_t>());
  if (key == "promote_window") o.promotion.window = v.as<int>();
  if (key == "promote_threshold") o.promotion.promote_threshold = v.as<int>();
  if (key == "demote_threshold") o.promotion.demote_threshold = v.as<int>();
  if (key == "event_capacity") o.event_capacity = v.as<int>();
  if (key == "decision_history") o.decision_history = v.as<int>();
  if (key == "log_level") o.log_level = v.as<std::string>();
  if (key == "address_file") o.address_file = v.as<std::string>();
  if (key == "state_file") o.state_file = v.as<std::string>();
  if (key == "token_file") o.token_file = v.as<std::string>();
  if (key == "insecure") o.insecure = v.as<bool>();
  if (key == "http_listen") o.http_listen = v.as<std::string>();
  if (key == "http_max_connections") o.http_max_connections = v.as<int>();
  if (key == "metrics_rank_series_max") o.metrics_rank_series_max = v.as<int>();
  if (key == "http_request_timeout_ms") o.http_request_timeout = absl::Milliseconds(v.as<int64_t>());
  if (key == "journal_file") o.journal_file = v.as<std::string>();
  if (key == "journal_retention_hours") o.journal_retention = absl::Hours(v.as<int64_t>());
  if (key == "journal_max_events") o.journal_max_events = v.as<int64_t>();
  if (key == "tls_cert_file") o.tls.cert_file = v.as<std::string>();
  if (key == "tls_key_file") o.tls.key_file = v.as<std::string>();
  if (key == "tls_client_ca_file") o.tls.client_ca_file = v.as<std::string>();
  if (key == "tls_reload_interval_s") o.tls.reload_interval = absl::Seconds(v.as<int64_t>());
  if (key == "recovery_window_ms") o.recovery_window = absl::Milliseconds(v.as<int64_t>());
  if (key == "max_world_size") o.limits.max_world_size = v.as<int>();
  if (key == "max_jobs") o.limits.max_jobs = v.as<int>();
  if (key == "max_total_ranks") o.limits.max_total_ranks = v.as<int>();
  if (key == "max_modules") o.limits.max_modules = v.as<int>();
  if (key == "max_units_per_module") o.limits.max_units_per_module = v.as<int>();
  if (key == "max_name_bytes") o.limits.max_name_bytes = v.as<int>();
  if (key == "max_pending_microbatches") o.limits.max_pending_microbatches = v.as<int>();
  if (key == "max_outbox_bytes") o.limits.max_outbox_bytes = v.as<int64_t>();
  if (key == "max_buffered_bytes") o.limits.max_buffered_bytes = v.as<int64_t>();
  if (key == "max_communicators_per_job") o.limits.max_communicators_per_job = v.as<int>();
  if (key == "max_store_value_bytes") o.limits.max_store_value_bytes = v.as<int>();
  if (key == "job_retention_ms") o.limits.job_retention = absl::Milliseconds(v.as<int64_t>());
  if (key == "handshake_timeout_ms") o.limits.handshake_timeout = absl::Milliseconds(v.as<int64_t>());
  if (key == "session_threads") o.session_threads = v.as<int>();
  if (key == "self_check_interval_ms") {
    o.limits.self_check_interval = absl::Milliseconds(v.as<int64_t>());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CoordinatorOptions> LoadConfigFile(const std::string& path,
                                                  CoordinatorOptions o) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    return absl::NotFoundError(absl::StrCat("config file ", path, " cannot be read"));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", path, " is not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return o;
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", path, " must be a mapping of key: value"));
  }
  static const std::set<std::string> kKeys = {
      "listen",           "default_policy",    "default_fallback",  "heartbeat_interval_ms",
      "heartbeat_timeout_ms", "plan_timeout_ms", "max_lookahead",   "promote_window",
      "promote_threshold", "demote_threshold", "event_capacity",    "decision_history",
      "log_level",        "address_file",      "behind_threshold_ms", "max_world_size", "max_total_ranks",
      "max_jobs",         "max_modules",       "max_units_per_module", "max_name_bytes",
      "max_pending_microbatches", "max_outbox_bytes", "max_buffered_bytes", "job_retention_ms", "handshake_timeout_ms",
      "self_check_interval_ms", "state_file", "recovery_window_ms", "max_communicators_per_job",
      "max_store_value_bytes", "token_file", "insecure",
      "tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_reload_interval_s", "http_listen",
      "http_max_connections", "http_request_timeout_ms", "metrics_rank_series_max",
      "journal_file", "journal_retention_hours", "journal_max_events", "session_threads"};
  for (const auto& kv : root) {
    if (!kv.first.IsScalar()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config file ", path, ": every key must be a plain name; accepted keys: ",
                       absl::StrJoin(kKeys, ", ")));
    }
    std::string key = kv.first.Scalar();
    if (!kKeys.count(key)) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": unknown key '", key,
                                                     "'; accepted keys: ",
                                                     absl::StrJoin(kKeys, ", ")));
    }
    try {
      if (absl::Status s = ApplyConfigKey(path, key, kv.second, o); !s.ok()) return s;
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": key '", key,
                                                     "' has a value of the wrong type (", e.what(),
                                                     ")"));
    }
  }
  return o;
}

// ---------------------------------------------------------------------------------------
// CheckServingNeeds: what a start needs beyond valid settings.

namespace {

std::string FolderOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// 0 when a new file can be made in `dir` (one is created and removed: access() says yes to
// root for any folder, and knows nothing of what a file system refuses); else the errno.
int CreateErrorIn(const std::string& dir) {
  std::string probe = absl::StrCat(dir, "/.shardcoordd-check-XXXXXX");
  const int fd = mkstemp(probe.data());
  if (fd < 0) return errno;
  ::close(fd);
  ::unlink(probe.c_str());
  return 0;
}

// The journal opens read-write in place (SQLite, with its -wal and -shm files beside it).
absl::Status CheckJournalFile(const std::string& path) {
  if (absl::Status s = CheckWritableFile("journal file", "--journal-file", path); !s.ok()) return s;
  const int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::OkStatus();  // Created at start, in a folder that takes files.
    return absl::FailedPreconditionError(absl::StrCat("journal file ", path, " cannot be opened for reading and writing (",
                                                      std::strerror(errno),
                                                      "); make it writable by the daemon's user or give another "
                                                      "--journal-file"));
  }
  char header[16] = {};
  const ssize_t n = ::read(fd, header, sizeof header);
  ::close(fd);
  // An empty file becomes a new journal; anything else must be an SQLite database.
  if (n != 0 && (n != static_cast<ssize_t>(sizeof header) || std::memcmp(header, "SQLite format 3", 16) != 0)) {
    return absl::FailedPreconditionError(absl::StrCat("journal file ", path,
                                                      " is not an SQLite file (so not a shardcoord journal): "
                                                      "move it away or give another --journal-file"));
  }
  return absl::OkStatus();
}

// The state file is replaced by a rename; its resume key, <state file>.key, is created
// beside it at the first start and must hold a key at every later one.
absl::Status CheckStateFile(const std::string& path) {
  if (absl::Status s = CheckWritableFile("state file", "--state-file", path, /*replaced=*/true); !s.ok()) return s;
  struct stat st {};
  if (::stat((path + ".key").c_str(), &st) != 0) return absl::OkStatus();
  return LoadResumeKey(path, "").status();
}

// gRPC serves TLS from a private copy of the certificate files under $TMPDIR (tls.h).
absl::Status CheckTlsCopyFolder() {
  const char* tmpdir = std::getenv("TMPDIR");
  const std::string parent = tmpdir != nullptr && *tmpdir != 0 ? tmpdir : "/tmp";
  if (const int err = CreateErrorIn(parent); err != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "TLS: the daemon serves from a private copy of the certificate files under ", parent,
        " ($TMPDIR, else /tmp), which does not take new files (", std::strerror(err),
        "); set TMPDIR to a writable folder (Kubernetes: an emptyDir volume at /tmp)"));
  }
  return absl::OkStatus();
}

// 0 when a socket bound to `a` listens (as the server's will: SO_REUSEADDR, no SO_REUSEPORT);
// the socket then stays open in `held`. Else the errno. `v6only`: an IPv6 socket takes IPv6
// only (when the IPv4 address is probed by a socket of its own); otherwise it is dual-stack,
// as gRPC binds [::], so an IPv4 listener on the port is found too.
int BindAndListen(const addrinfo& a, bool v6only, std::vector<int>& held) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_CLOEXEC, a.ai_protocol);
  if (fd < 0) return errno;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const int v6 = v6only ? 1 : 0;
  if (a.ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6, sizeof v6);
  if (::bind(fd, a.ai_addr, a.ai_addrlen) != 0 || ::listen(fd, 1) != 0) {
    const int err = errno;
    ::close(fd);
    return err;
  }
  held.push_back(fd);
  return 0;
}

struct Listener {
  std::string setting;  // "listen" or "http_listen"
  std::string flag;     // "--listen" or "--http-listen"
  std::string address;  // HOST:PORT as configured
  std::string host, port;
};

std::string ListenProblem(const Listener& l, int err, const std::string& taken_by) {
  const std::string head = absl::StrCat(l.setting, " ", l.address, ": ");
  const std::string other = absl::StrCat(" with ", l.flag, " HOST:PORT (port 0 picks a free one)");
  if (err == EADDRINUSE && !taken_by.empty()) {
    return absl::StrCat(head, "port ", l.port, " is the port of ", taken_by, "; give them different ports", other);
  }
  if (err == EADDRINUSE) {
    return absl::StrCat(head, "port ", l.port, " is already in use (another shardcoordd or program: `ss -ltnp 'sport = :",
                        l.port, "'` names it); stop it or give another port", other);
  }
  if (err == EADDRNOTAVAIL) {
    return absl::StrCat(head, l.host, " is not an address of this host; give one of its addresses, or 0.0.0.0 for all,",
                        other);
  }
  if (err == EACCES) {
    return absl::StrCat(head, "port ", l.port, " is below 1024 and needs a privilege (CAP_NET_BIND_SERVICE) the daemon ",
                        "lacks; give a port from 1024 up", other);
  }
  return absl::StrCat(head, "cannot listen (", std::strerror(err), "); give another address", other);
}

// Binds and listens on every address `l` resolves to, keeping the sockets in `held` so that
// the next listener is checked against this one too. `taken_by` names the earlier listener
// whose port this one shares, if any.
absl::Status ProbeListener(const Listener& l, bool ip_only, const std::string& taken_by, std::vector<int>& held) {
  int port = -1;
  if (!absl::SimpleAtoi(l.port, &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(l.setting, " '", l.address,
                                                   "' must be HOST:PORT with a port in 0..65535; fix ", l.flag));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV | (ip_only ? AI_NUMERICHOST : 0);
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(l.host.empty() ? nullptr : l.host.c_str(), l.port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        l.setting, " ", l.address, ": '", l.host, "' ",
        ip_only ? "is not an IP address (or localhost)" : absl::StrCat("cannot be resolved (", gai_strerror(rc), ")"),
        "; give an address of this host, or 0.0.0.0 for all, with ", l.flag));
  }
  bool has_v4 = false;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) has_v4 = has_v4 || a->ai_family == AF_INET;
  int bound = 0;
  int error = 0;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int err = BindAndListen(*a, /*v6only=*/has_v4, held);
    if (err == 0) ++bound;
    if (err != 0 && (error == 0 || err == EADDRINUSE)) error = err;
  }
  ::freeaddrinfo(found);
  // One family missing (no IPv6 here) is fine, as it is to gRPC; a port in use is not.
  if (bound > 0 && error != EADDRINUSE) return absl::OkStatus();
  return absl::UnavailableError(ListenProblem(l, error, taken_by));
}

Listener SplitListener(const std::string& setting, const std::string& flag, const std::string& address, bool ip_only) {
  Listener l{setting, flag, address, "", ""};
  const size_t colon = address.rfind(':');
  l.host = colon == std::string::npos ? address : address.substr(0, colon);
  l.port = colon == std::string::npos ? "" : address.substr(colon + 1);
  if (l.host.size() >= 2 && l.host.front() == '[' && l.host.back() == ']') l.host = l.host.substr(1, l.host.size() - 2);
  // The HTTP listener's own reading (http_server.cc): localhost is 127.0.0.1, no host is 0.0.0.0.
  if (ip_only && l.host == "localhost") l.host = "127.0.0.1";
  if (ip_only && l.host.empty()) l.host = "0.0.0.0";
  return l;
}

}  // namespace

absl::Status CheckWritableFile(const std::string& what, const std::string& flag, const std::string& path,
                               bool replaced) {
  const std::string dir = FolderOf(path);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(what, " ", path, ": its folder ", dir,
                                                      " does not exist (or is not a folder); create it, writable by "
                                                      "the daemon's user, or give another ",
                                                      flag));
  }
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " ", path, " is a folder; give a file's path with ", flag));
  }
  if (const int err = CreateErrorIn(dir); err != 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, " ", path, ": its folder ", dir,
                                                      " does not take new files (", std::strerror(err),
                                                      "); make it writable by the daemon's user or give another ",
                                                      flag));
  }
  if (!replaced && ::stat(path.c_str(), &st) == 0) {  // Present: it must open for writing (nothing is written).
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat(what, " ", path, " exists and does not open for writing (",
                                                        std::strerror(errno), "); give the daemon's user write access ",
                                                        "to it, or give another ", flag));
    }
    ::close(fd);
  }
  return absl::OkStatus();
}

std::vector<std::string> CheckServingNeeds(const CoordinatorOptions& o) {
  std::vector<std::string> problems;
  auto add = [&problems](const absl::Status& s) {
    if (!s.ok()) problems.emplace_back(s.message());
  };
  add(CheckTls(o.tls));
  if (o.tls.enabled()) add(CheckTlsCopyFolder());
  if (!o.token_file.empty()) add(Tokens::Load(o.token_file).status());
  if (!o.journal_file.empty()) add(CheckJournalFile(o.journal_file));
  if (!o.state_file.empty()) add(CheckStateFile(o.state_file));
  if (!o.address_file.empty()) add(CheckWritableFile("address file", "--address-file", o.address_file));
  std::vector<int> held;
  const Listener grpc = SplitListener("listen", "--listen", o.listen_address, false);
  add(ProbeListener(grpc, false, "", held));
  if (!o.http_listen.empty()) {
    const Listener http = SplitListener("http_listen", "--http-listen", o.http_listen, true);
    const bool same_port = http.port == grpc.port && http.port != "0";
    add(ProbeListener(http, true, same_port ? absl::StrCat("listen ", o.listen_address) : "", held));
  }
  for (const int fd : held) ::close(fd);
  return problems;
}

}  // namespace shardcoord::coordinator
