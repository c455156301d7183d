// shardcoordd: the shardcoord coordinator daemon.
//
//   shardcoordd [--config FILE] [--listen HOST:PORT] [--default-policy auto] ...
//
// Settings come from the optional YAML file, then from flags (flags win). Stops cleanly
// on SIGTERM or SIGINT: every session gets a shutdown notice and its stream is closed.
#include <signal.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/stubs/logging.h"
#include "shardcoord/plan_check.h"
#include "coordinator/coordinator_server.h"
#include "coordinator/options.h"
#include "coordinator/resume_auth.h"
#include "coordinator/state_file.h"
#include "shardcoord/version.h"
#include "coordinator/auth.h"
#include "coordinator/tls.h"
#include "shardcoord/internal/logging.h"

namespace {

using shardcoord::coordinator::CoordinatorOptions;

// Writes atomically, so a reader never sees a half-written address.
bool WriteAddressFile(const std::string& path, const std::string& address) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) return false;
    out << address << "\n";
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// Every rank holds one connection (one descriptor) for its whole run, and operators' queries
// one each while they last. gRPC 1.51 stops accepting for good once accept() fails with
// EMFILE, so run with the hard limit, not the default soft one (1024). Deploy files raise
// the hard limit; README "Limits" says how many a job needs.
void RaiseFileLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const rlim_t before = lim.rlim_cur;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) lim.rlim_cur = before;
  }
  shardcoord::logging::Get("coordinator")
      ->info("open file limit {} (was {}, hard limit {}): about {} ranks", lim.rlim_cur, before, lim.rlim_max,
             lim.rlim_cur > 64 ? lim.rlim_cur - 64 : 0);
}

// protobuf logs an ERROR on stderr for each string field with invalid UTF-8 it parses, so a
// client sending such messages could flood the log: route it through our logger, rate-limited.
void RouteProtobufLogs() {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel level, const char*, int, const std::string& message) {
    static shardcoord::logging::RateLimit limit(10);
    int64_t suppressed = 0;
    if (!limit.Allow(&suppressed)) return;
    shardcoord::logging::Get("coordinator")
        ->warn("protobuf{}: {}{}", level >= google::protobuf::LOGLEVEL_ERROR ? " error" : "",
               shardcoord::Printable(message),
               suppressed > 0 ? absl::StrCat(" (", suppressed, " more held back)") : std::string());
  });
}

// Command-line flags; an unset one keeps the config file's (or the built-in) value.
struct Flags {
  std::string config_file;
  std::string listen, policy, fallback, log_level, address_file, state_file, token_file;
  std::string tls_cert, tls_key, tls_client_ca, http_listen, http_address_file, journal_file;
  std::optional<int64_t> journal_retention_hours, journal_max_events;
  bool check_config = false;
  std::optional<int64_t> tls_reload_s;
  std::optional<int> http_max_connections;
  std::optional<int64_t> http_request_timeout_ms;
  bool insecure = false;
  std::optional<int64_t> hb_interval_ms, hb_timeout_ms, plan_timeout_ms, behind_threshold_ms, recovery_window_ms;
  std::optional<int> max_lookahead, promote_window, promote_threshold, demote_threshold, event_capacity,
      decision_history, max_world_size, max_total_ranks, max_jobs, max_modules, max_units, max_name_bytes, max_pending;
  std::optional<int64_t> max_outbox_bytes, max_buffered_bytes, job_retention_ms, handshake_timeout_ms, self_check_ms;
  std::optional<int> max_comms, max_store_value, session_threads;
};

// Who may connect (tokens, TLS), what else the daemon serves (HTTP) and keeps (the journal).
void AddSecurityAndObservabilityFlags(CLI::App& app, Flags& f) {
  app.add_option("--token-file", f.token_file,
                 "tokens with roles (lines 'ROLE TOKEN [job=ID]', mode 600); every call must then carry one")
      ->envname("SHARDCOORD_DAEMON_TOKEN_FILE");
  app.add_option("--http-listen", f.http_listen,
                 "serve the status page, /metrics and /healthz over HTTP on HOST:PORT (off by default)")
      ->envname("SHARDCOORD_DAEMON_HTTP_LISTEN");
  app.add_option("--http-max-connections", f.http_max_connections,
                 "HTTP connections open at once; more are closed at accept (default 64)");
  app.add_option("--http-request-timeout-ms", f.http_request_timeout_ms,
                 "the time one HTTP exchange (TLS handshake, request, response) may take (default 5000)");
  app.add_flag("--check-config", f.check_config,
               "check the settings and what serving needs (TLS and token files readable, journal, state and "
               "address files writable, ports free) and exit: 0 when the daemon would start");
  app.add_option("--journal-file", f.journal_file,
                 "keep every event in this SQLite file too, across restarts (shardctl events reads it)");
  app.add_option("--journal-retention-hours", f.journal_retention_hours, "delete journal events older than this");
  app.add_option("--journal-max-events", f.journal_max_events, "keep at most this many journal events");
  app.add_option("--http-address-file", f.http_address_file,
                 "write the HTTP listener's bound HOST:PORT here once serving (for --http-listen ...:0)");
  app.add_option("--tls-cert", f.tls_cert, "PEM certificate chain: serve TLS only (with --tls-key)")
      ->envname("SHARDCOORD_DAEMON_TLS_CERT");
  app.add_option("--tls-key", f.tls_key, "PEM private key of --tls-cert (mode 600)")
      ->envname("SHARDCOORD_DAEMON_TLS_KEY");
  app.add_option("--tls-client-ca", f.tls_client_ca,
                 "PEM CA bundle: require callers' certificates signed by it (mutual TLS)")
      ->envname("SHARDCOORD_DAEMON_TLS_CLIENT_CA");
  app.add_option("--tls-reload-interval-s", f.tls_reload_s,
                 "check the TLS files this often; renewed ones serve new connections without a restart");
  app.add_flag("--insecure", f.insecure,
               "serve a non-loopback address without TLS or tokens (anyone who reaches it may act for any rank)");
}

void AddFlags(CLI::App& app, Flags& f) {
  app.add_option("--config", f.config_file,
                 "YAML config file (keys as in README 'shardcoordd configuration' and deploy/config)")
      ->check(CLI::ExistingFile);
  app.add_option("--listen", f.listen, "address to serve on, HOST:PORT (port 0 picks a free port)")
      ->envname("SHARDCOORD_DAEMON_LISTEN");
  app.add_option("--default-policy", f.policy, "policy for ranks that send none")
      ->check(CLI::IsMember({"auto", "per_layer", "root", "replicate"}));
  app.add_option("--default-fallback", f.fallback, "fallback for ranks that send none")
      ->check(CLI::IsMember({"root", "replicate"}));
  app.add_option("--heartbeat-interval-ms", f.hb_interval_ms, "heartbeat interval told to workers");
  app.add_option("--heartbeat-timeout-ms", f.hb_timeout_ms, "silence after which a rank is dead");
  app.add_option("--plan-timeout-ms", f.plan_timeout_ms,
                 "how long a microbatch may wait for the plans of missing ranks");
  app.add_option("--max-lookahead", f.max_lookahead, "largest lookahead a rank may register");
  app.add_option("--behind-threshold-ms", f.behind_threshold_ms,
                 "name a rank as behind once others waited this long in a collective it has not issued");
  app.add_option("--promote-window", f.promote_window, "auto promotion: microbatches considered");
  app.add_option("--promote-threshold", f.promote_threshold,
                 "auto promotion: microbatches in the window that gather the module, to promote");
  app.add_option("--demote-threshold", f.demote_threshold,
                 "auto promotion: at most this many gathering microbatches in a full window demotes");
  app.add_option("--event-capacity", f.event_capacity, "events kept for shardctl events");
  app.add_option("--decision-history", f.decision_history, "decisions kept per group for shardctl decisions");
  app.add_option("--max-world-size", f.max_world_size, "most ranks one job may have");
  app.add_option("--max-total-ranks", f.max_total_ranks, "most ranks of all jobs held at once");
  app.add_option("--max-jobs", f.max_jobs, "most jobs held at once (finished ones until evicted)");
  app.add_option("--max-modules", f.max_modules, "most controlled modules in a manifest");
  app.add_option("--max-units-per-module", f.max_units, "most layer units of one module");
  app.add_option("--max-name-bytes", f.max_name_bytes, "longest job id, module, unit or host name");
  app.add_option("--max-pending-microbatches", f.max_pending,
                 "per group: most microbatches reported by some ranks and not yet by all");
  app.add_option("--max-communicators-per-job", f.max_comms, "named communicators one job may open");
  app.add_option("--max-store-value-bytes", f.max_store_value, "largest value in a communicator epoch's store");
  app.add_option("--max-outbox-bytes", f.max_outbox_bytes,
                 "per rank: most bytes queued for a rank that does not read; over it the rank is failed");
  app.add_option("--max-buffered-bytes", f.max_buffered_bytes,
                 "daemon-wide: memory held for all clients (queues, resumes); past it the ranks holding "
                 "most are failed and resumes refused");
  app.add_option("--job-retention-ms", f.job_retention_ms, "forget a job this long after its last rank ended");
  app.add_option("--handshake-timeout-ms", f.handshake_timeout_ms,
                 "close connections that have not completed the HTTP/2 handshake by then");
  app.add_option("--self-check-interval-ms", f.self_check_ms,
                 "check this often that the listener still accepts connections (0: never)");
  app.add_option("--session-threads", f.session_threads,
                 "threads serving the rank streams, each with its own completion queue (0: one per core)");
  app.add_option("--log-level", f.log_level, "trace, debug, info, warn, error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  app.add_option("--address-file", f.address_file,
                 "write the bound HOST:PORT here once serving (for --listen ...:0)");
  AddSecurityAndObservabilityFlags(app, f);
  app.add_option("--state-file", f.state_file,
                 "keep the incarnation here across restarts (optional: recovery works without it)");
  app.add_option("--recovery-window-ms", f.recovery_window_ms,
                 "after a restart, how long groups wait for their ranks to resume before failing them");
}

// Flags win over the config file.
void ApplyFlags(const Flags& f, CoordinatorOptions& options) {
  if (!f.listen.empty()) options.listen_address = f.listen;
  if (!f.policy.empty()) options.default_policy = *shardcoord::ParsePolicy(f.policy);
  if (!f.fallback.empty()) options.default_fallback = *shardcoord::ParseFallback(f.fallback);
  if (f.hb_interval_ms) options.heartbeat_interval = absl::Milliseconds(*f.hb_interval_ms);
  if (f.hb_timeout_ms) options.heartbeat_timeout = absl::Milliseconds(*f.hb_timeout_ms);
  if (f.plan_timeout_ms) options.plan_timeout = absl::Milliseconds(*f.plan_timeout_ms);
  if (f.max_lookahead) options.max_lookahead = *f.max_lookahead;
  if (f.behind_threshold_ms) options.behind_threshold = absl::Milliseconds(*f.behind_threshold_ms);
  if (f.promote_window) options.promotion.window = *f.promote_window;
  if (f.promote_threshold) options.promotion.promote_threshold = *f.promote_threshold;
  if (f.demote_threshold) options.promotion.demote_threshold = *f.demote_threshold;
  if (f.event_capacity) options.event_capacity = *f.event_capacity;
  if (f.decision_history) options.decision_history = *f.decision_history;
  if (f.max_world_size) options.limits.max_world_size = *f.max_world_size;
  if (f.max_jobs) options.limits.max_jobs = *f.max_jobs;
  if (f.max_total_ranks) options.limits.max_total_ranks = *f.max_total_ranks;
  if (f.max_modules) options.limits.max_modules = *f.max_modules;
  if (f.max_units) options.limits.max_units_per_module = *f.max_units;
  if (f.max_name_bytes) options.limits.max_name_bytes = *f.max_name_bytes;
  if (f.max_pending) options.limits.max_pending_microbatches = *f.max_pending;
  if (f.max_outbox_bytes) options.limits.max_outbox_bytes = *f.max_outbox_bytes;
  if (f.max_buffered_bytes) options.limits.max_buffered_bytes = *f.max_buffered_bytes;
  if (f.max_comms) options.limits.max_communicators_per_job = *f.max_comms;
  if (f.max_store_value) options.limits.max_store_value_bytes = *f.max_store_value;
  if (f.job_retention_ms) options.limits.job_retention = absl::Milliseconds(*f.job_retention_ms);
  if (f.handshake_timeout_ms) options.limits.handshake_timeout = absl::Milliseconds(*f.handshake_timeout_ms);
  if (f.self_check_ms) options.limits.self_check_interval = absl::Milliseconds(*f.self_check_ms);
  if (f.session_threads) options.session_threads = *f.session_threads;
  if (!f.log_level.empty()) options.log_level = f.log_level;
  if (!f.address_file.empty()) options.address_file = f.address_file;
  if (!f.state_file.empty()) options.state_file = f.state_file;
  if (!f.token_file.empty()) options.token_file = f.token_file;
  if (f.insecure) options.insecure = true;
  if (!f.http_listen.empty()) options.http_listen = f.http_listen;
  if (f.http_max_connections) options.http_max_connections = *f.http_max_connections;
  if (f.http_request_timeout_ms) options.http_request_timeout = absl::Milliseconds(*f.http_request_timeout_ms);
  if (!f.journal_file.empty()) options.journal_file = f.journal_file;
  if (f.journal_retention_hours) options.journal_retention = absl::Hours(*f.journal_retention_hours);
  if (f.journal_max_events) options.journal_max_events = *f.journal_max_events;
  if (!f.tls_cert.empty()) options.tls.cert_file = f.tls_cert;
  if (!f.tls_key.empty()) options.tls.key_file = f.tls_key;
  if (!f.tls_client_ca.empty()) options.tls.client_ca_file = f.tls_client_ca;
  if (f.tls_reload_s) options.tls.reload_interval = absl::Seconds(*f.tls_reload_s);
  if (f.recovery_window_ms) options.recovery_window = absl::Milliseconds(*f.recovery_window_ms);
}

// Serves until SIGTERM or SIGINT. Exit codes: 0 stopped, 1 cannot write the address file,
// 2 cannot listen.
int Serve(CoordinatorOptions options, const std::string& http_address_file) {
  RouteProtobufLogs();
  RaiseFileLimit();
  options.incarnation = shardcoord::coordinator::NextIncarnation(options.state_file, absl::Now());
  // The resume key (resume_auth.h): from <state file>.key, else the token file, else none.
  auto resume_key = shardcoord::coordinator::LoadResumeKey(options.state_file, options.token_file);
  if (resume_key.ok()) {
    options.resume_key = resume_key->key;
    shardcoord::logging::Get("coordinator")->info("resume key from {}: resumes after a restart are verified",
                                                  resume_key->source);
  } else if (absl::IsNotFound(resume_key.status()) && options.token_file.empty()) {
    // Fine on a trusted loopback (the demo, the tests): said, not warned, so that a clean run
    // logs no warning; off loopback a forged resume could hand a group decisions nobody made.
    shardcoord::logging::Get("coordinator")
        ->log(shardcoord::coordinator::IsLoopbackAddress(options.listen_address) ? spdlog::level::info
                                                                                 : spdlog::level::warn,
              "no --state-file or --token-file: resumes after a restart of this daemon cannot be verified and are "
              "taken as sent (fine on a trusted loopback; set --state-file to keep a resume key)");
  } else {
    std::cerr << "shardcoordd: " << resume_key.status().message() << std::endl;
    return 2;
  }

  // Abseil's deadlock detector (on in Debian's build) costs a graph update per lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Block the stop signals in every thread; the main thread waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // A daemon that can no longer accept connections is useless to new and returning ranks
  // and cannot heal in-process (gRPC 1.51): exit 3, so that the supervisor restarts it.
  auto server = shardcoord::coordinator::CoordinatorServer::Start(options, nullptr, [](const std::string& why) {
    std::cerr << "shardcoordd: exiting (3): " << why << std::endl;
    std::_Exit(3);
  });
  if (!server.ok()) {
    std::cerr << "shardcoordd: " << server.status().message() << "\n";
    return 2;
  }
  auto log = shardcoord::logging::Get("coordinator");
  if (!shardcoord::coordinator::IsLoopbackAddress(options.listen_address)) {
    if (options.token_file.empty()) {
      log->warn("INSECURE: serving {} without tokens (--insecure): anyone who reaches this port can register, "
                "act for and read every rank; give --token-file instead", options.listen_address);
    }
    if (!options.tls.enabled()) {
      log->warn("INSECURE: serving {} without TLS (--insecure): tokens, plans and rendezvous data travel in "
                "clear text; give --tls-cert and --tls-key", options.listen_address);
    }
  }
  if (!http_address_file.empty() && !WriteAddressFile(http_address_file, (*server)->http_address())) {
    std::cerr << "shardcoordd: cannot write --http-address-file " << http_address_file << "\n";
    return 1;
  }
  if (!options.address_file.empty() &&
      !WriteAddressFile(options.address_file, (*server)->address())) {
    std::cerr << "shardcoordd: cannot write --address-file " << options.address_file << "\n";
    return 1;
  }
  log->info("ready address={} default_policy={} default_fallback={} heartbeat_interval_ms={} "
            "heartbeat_timeout_ms={} plan_timeout_ms={} max_lookahead={} incarnation={}",
            (*server)->address(), shardcoord::PolicyName(options.default_policy),
            shardcoord::FallbackName(options.default_fallback),
            absl::ToInt64Milliseconds(options.heartbeat_interval),
            absl::ToInt64Milliseconds(options.heartbeat_timeout),
            absl::ToInt64Milliseconds(options.plan_timeout), options.max_lookahead, options.incarnation);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  log->info("signal={} shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown();
  return 0;
}

// Environment variables all start with SHARDCOORD_; those only the daemon reads are
// SHARDCOORD_DAEMON_<SETTING> (the daemon's token table is not a client's token file). The
// names from before that scheme are still read, with one warning each.
struct RenamedEnv {
  const char* old_name;
  const char* new_name;
};
constexpr RenamedEnv kRenamedEnv[] = {
    {"SHARDCOORDD_TOKEN_FILE", "SHARDCOORD_DAEMON_TOKEN_FILE"},
    {"SHARDCOORDD_TLS_CERT", "SHARDCOORD_DAEMON_TLS_CERT"},
    {"SHARDCOORDD_TLS_KEY", "SHARDCOORD_DAEMON_TLS_KEY"},
    {"SHARDCOORDD_TLS_CLIENT_CA", "SHARDCOORD_DAEMON_TLS_CLIENT_CA"},
    {"SHARDCOORD_LISTEN", "SHARDCOORD_DAEMON_LISTEN"},
    {"SHARDCOORD_HTTP_LISTEN", "SHARDCOORD_DAEMON_HTTP_LISTEN"},
};

// Before the flags are parsed: an old name stands for its new one unless that is set too.
void AdoptRenamedEnv() {
  auto log = shardcoord::logging::Get("coordinator");
  for (const RenamedEnv& r : kRenamedEnv) {
    const char* old_value = std::getenv(r.old_name);
    if (old_value == nullptr) continue;
    if (std::getenv(r.new_name) != nullptr) {
      log->warn("{} is deprecated and ignored: {} is set too and wins; unset {}", r.old_name, r.new_name, r.old_name);
      continue;
    }
    setenv(r.new_name, old_value, 0);
    log->warn("{} is deprecated: rename it {} (read as that this time)", r.old_name, r.new_name);
  }
}

// --check-config once the settings are valid: what serving needs too. 0 only when a start
// would serve; 2 with one line per problem otherwise.
int CheckConfig(const CoordinatorOptions& options, const std::string& http_address_file) {
  std::vector<std::string> problems = shardcoord::coordinator::CheckServingNeeds(options);
  if (!http_address_file.empty()) {
    absl::Status s = shardcoord::coordinator::CheckWritableFile("HTTP address file", "--http-address-file",
                                                                http_address_file);
    if (!s.ok()) problems.emplace_back(s.message());
  }
  for (const std::string& problem : problems) std::cerr << "shardcoordd: " << problem << "\n";
  if (!problems.empty()) {
    std::cerr << "shardcoordd: --check-config: the daemon would not start (" << problems.size()
              << (problems.size() == 1 ? " problem" : " problems") << " above)\n";
    return 2;
  }
  std::cout << "shardcoordd: settings OK, and what serving needs is in place (listen " << options.listen_address
            << (options.http_listen.empty() ? "" : ", http_listen " + options.http_listen)
            << (options.journal_file.empty() ? "" : ", journal " + options.journal_file)
            << (options.state_file.empty() ? "" : ", state " + options.state_file) << ")\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardcoordd: coordinator for frozen multimodal FSDP sharding decisions"};
  app.set_version_flag("--version", std::string("shardcoordd ") + shardcoord::kVersion);
  Flags f;
  AddFlags(app, f);
  AdoptRenamedEnv();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2, as documented.
    return app.exit(e) == 0 ? 0 : 2;
  }

  CoordinatorOptions options;
  if (!f.config_file.empty()) {
    auto loaded = shardcoord::coordinator::LoadConfigFile(f.config_file, options);
    if (!loaded.ok()) {
      std::cerr << "shardcoordd: " << loaded.status().message() << "\n";
      return 2;
    }
    options = *loaded;
  }
  ApplyFlags(f, options);
  if (!shardcoord::logging::SetLevel(options.log_level)) {
    std::cerr << "shardcoordd: unknown log level '" << options.log_level
              << "'; use trace, debug, info, warn, error or off\n";
    return 2;
  }
  if (absl::Status s = shardcoord::coordinator::ValidateOptions(options); !s.ok()) {
    std::cerr << "shardcoordd: " << s.message() << "\n";
    return 2;
  }
  if (f.check_config) return CheckConfig(options, f.http_address_file);
  return Serve(options, f.http_address_file);
}
