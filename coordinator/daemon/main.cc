// shardcoordd: the shardcoord coordinator daemon.
//
//   shardcoordd [--config FILE] [--listen HOST:PORT] [--default-policy auto] ...
//
// Settings come from the optional YAML file, then from environment variables and flags
// (flags win); each setting's key, flag and range are one entry of Settings() (options.h).
// Stops cleanly on SIGTERM or SIGINT: every session gets a shutdown notice and its stream is
// closed.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/stubs/logging.h"
#include "shardcoord/plan_check.h"
#include "coordinator/server/coordinator_server.h"
#include "coordinator/settings/options.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/daemon/state_file.h"
#include "coordinator/daemon/serving_check.h"
#include "shardcoord/version.h"
#include "coordinator/server/auth.h"
#include "coordinator/server/tls.h"
#include "shardcoord/internal/logging.h"

namespace {

using shardcoord::coordinator::CoordinatorOptions;
using shardcoord::coordinator::FlagName;
using shardcoord::coordinator::IsSwitch;
using shardcoord::coordinator::Setting;
using shardcoord::coordinator::SettingChoices;
using shardcoord::coordinator::SettingValueText;
using shardcoord::coordinator::SetFromText;
using shardcoord::coordinator::ValueTypeName;

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

// One setting's flag as parsed (Settings(), options.h): its argument, or for a switch
// whether it is on, and the same for the flag's previous name where it was renamed.
struct SettingFlag {
  std::string text, old_text;
  bool on = false, old_on = false;
  CLI::Option* option = nullptr;
  CLI::Option* old_option = nullptr;  // Hidden from --help.
};

// Command-line flags; a setting whose flag is not given keeps the config file's (or the
// built-in) value.
struct Flags {
  std::string config_file;
  bool check_config = false;
  std::string http_address_file;  // Not a setting: the daemon's options never need it.
  // One per entry of Settings(), in its order. Sized before the flags are added: CLI11 keeps
  // references into it.
  std::vector<SettingFlag> settings;
};

// A setting's flag under `name`: a switch takes no value; the others take one, checked
// against the setting's names where it has some.
CLI::Option* AddSettingFlag(CLI::App& app, const Setting& s, const std::string& name, std::string& text,
                            bool& on) {
  std::string help = s.help;
  if (s.env) absl::StrAppend(&help, " [env ", shardcoord::coordinator::EnvName(s.key), "]");
  if (IsSwitch(s)) return app.add_flag(name, on, help);
  CLI::Option* option = app.add_option(name, text, help)->type_name(ValueTypeName(s));
  const std::string builtin = SettingValueText(s, CoordinatorOptions{});
  if (!builtin.empty()) option->default_str(builtin);
  if (std::vector<std::string> choices = SettingChoices(s); !choices.empty()) option->check(CLI::IsMember(choices));
  return option;
}

void AddFlags(CLI::App& app, Flags& f) {
  app.add_option("--config", f.config_file,
                 "YAML config file (keys as in README 'shardcoordd configuration' and deploy/config; each is also "
                 "the flag of the same name with dashes)")
      ->check(CLI::ExistingFile);
  const std::vector<Setting>& table = shardcoord::coordinator::Settings();
  f.settings.resize(table.size());
  for (size_t i = 0; i < table.size(); ++i) {
    const Setting& s = table[i];
    SettingFlag& flag = f.settings[i];
    flag.option = AddSettingFlag(app, s, FlagName(s.key), flag.text, flag.on);
    if (s.renamed_from != nullptr) {
      flag.old_option = AddSettingFlag(app, s, FlagName(s.renamed_from), flag.old_text, flag.old_on)->group("");
    }
  }
  app.add_flag("--check-config", f.check_config,
               "check the settings and what serving needs (TLS and token files readable, journal, state and "
               "address files writable, ports free) and exit: 0 when the daemon would start");
  app.add_option("--http-address-file", f.http_address_file,
                 "write the HTTP listener's bound HOST:PORT here once serving (for --http-listen ...:0)");
}

// A setting's value from the command line or the environment, and where it came from
// ("--listen", "SHARDCOORD_DAEMON_LISTEN") for messages.
struct GivenValue {
  std::string text;
  std::string from;
};

// Its flag, else its previous flag (with one deprecation line), else its environment
// variable; nothing: the setting keeps the config file's value.
std::optional<GivenValue> Given(const Setting& s, const SettingFlag& flag) {
  const std::string name = FlagName(s.key);
  const bool given = flag.option->count() > 0;
  if (flag.old_option != nullptr && flag.old_option->count() > 0) {
    const std::string old_name = FlagName(s.renamed_from);
    auto log = shardcoord::logging::Get("coordinator");
    if (given) {
      log->warn("{} is deprecated and ignored: {} is given too and wins; drop {}", old_name, name, old_name);
    } else {
      log->warn("{} is deprecated: rename it {} (read as that this time)", old_name, name);
      return GivenValue{IsSwitch(s) ? (flag.old_on ? "true" : "false") : flag.old_text, old_name};
    }
  }
  if (given) return GivenValue{IsSwitch(s) ? (flag.on ? "true" : "false") : flag.text, name};
  const std::string env = shardcoord::coordinator::EnvName(s.key);
  const char* value = s.env ? std::getenv(env.c_str()) : nullptr;
  if (value != nullptr && *value != '\0') return GivenValue{value, env};  // Empty: unset, as CLI11 took it.
  return std::nullopt;
}

// Flags win over their environment variables, which win over the config file. False (said on
// stderr) when a value is refused.
bool ApplyFlags(const Flags& f, CoordinatorOptions& options) {
  const std::vector<Setting>& table = shardcoord::coordinator::Settings();
  for (size_t i = 0; i < table.size(); ++i) {
    std::optional<GivenValue> given = Given(table[i], f.settings[i]);
    if (!given) continue;
    if (absl::Status s = SetFromText(table[i], given->text, options); !s.ok()) {
      std::cerr << "shardcoordd: " << given->from << ": " << s.message() << "\n";
      return false;
    }
  }
  return true;
}

// Takes the resume key (resume_auth.h) into `options`: from <state file>.key, else the token
// file, else none (said as info on loopback, as a warning elsewhere). False: the key file is
// unusable (said on stderr).
bool TakeResumeKey(CoordinatorOptions& options) {
  auto resume_key = shardcoord::coordinator::LoadResumeKey(options.state_file, options.token_file);
  if (resume_key.ok()) {
    options.resume_key = resume_key->key;
    shardcoord::logging::Get("coordinator")->info("resume key from {}: resumes after a restart are verified",
                                                  resume_key->source);
    return true;
  }
  if (absl::IsNotFound(resume_key.status()) && options.token_file.empty()) {
    // Fine on a trusted loopback (the demo, the tests): said, not warned, so that a clean run
    // logs no warning; off loopback a forged resume could hand a group decisions nobody made.
    shardcoord::logging::Get("coordinator")
        ->log(shardcoord::coordinator::IsLoopbackAddress(options.listen_address) ? spdlog::level::info
                                                                                 : spdlog::level::warn,
              "no --state-file or --token-file: resumes after a restart of this daemon cannot be verified and are "
              "taken as sent (fine on a trusted loopback; set --state-file to keep a resume key)");
    return true;
  }
  std::cerr << "shardcoordd: " << resume_key.status().message() << std::endl;
  return false;
}

// Serving beyond loopback without tokens or TLS (only with --insecure): one warning each.
void WarnIfInsecure(const CoordinatorOptions& options) {
  if (shardcoord::coordinator::IsLoopbackAddress(options.listen_address)) return;
  auto log = shardcoord::logging::Get("coordinator");
  if (options.token_file.empty()) {
    log->warn("INSECURE: serving {} without tokens (--insecure): anyone who reaches this port can register, "
              "act for and read every rank; give --token-file instead", options.listen_address);
  }
  if (!options.tls.enabled()) {
    log->warn("INSECURE: serving {} without TLS (--insecure): tokens, plans and rendezvous data travel in "
              "clear text; give --tls-cert-file and --tls-key-file", options.listen_address);
  }
}

// Writes the address files asked for; false (said on stderr) when one cannot be written.
bool WriteAddressFiles(const CoordinatorOptions& options, const std::string& http_address_file,
                       const shardcoord::coordinator::CoordinatorServer& server) {
  if (!http_address_file.empty() && !WriteAddressFile(http_address_file, server.http_address())) {
    std::cerr << "shardcoordd: cannot write --http-address-file " << http_address_file << "\n";
    return false;
  }
  if (!options.address_file.empty() && !WriteAddressFile(options.address_file, server.address())) {
    std::cerr << "shardcoordd: cannot write --address-file " << options.address_file << "\n";
    return false;
  }
  return true;
}

// Serves until SIGTERM or SIGINT. Exit codes: 0 stopped, 1 cannot write the address file,
// 2 cannot listen.
int Serve(CoordinatorOptions options, const std::string& http_address_file) {
  RouteProtobufLogs();
  RaiseFileLimit();
  options.incarnation = shardcoord::coordinator::NextIncarnation(options.state_file, absl::Now());
  if (!TakeResumeKey(options)) return 2;

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
  WarnIfInsecure(options);
  if (!WriteAddressFiles(options, http_address_file, **server)) return 1;
  auto log = shardcoord::logging::Get("coordinator");
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
// SHARDCOORD_DAEMON_<KEY> (EnvName; the daemon's token table is not a client's token file).
// The names from before are still read, with one warning each: those of renamed flags
// (SHARDCOORD_DAEMON_TLS_CERT, from the table), and these from before that scheme.
struct RenamedEnv {
  const char* old_name;
  const char* key;  // The setting it stands for.
};
constexpr RenamedEnv kRenamedEnv[] = {
    {"SHARDCOORDD_TOKEN_FILE", "token_file"},
    {"SHARDCOORDD_TLS_CERT", "tls_cert_file"},
    {"SHARDCOORDD_TLS_KEY", "tls_key_file"},
    {"SHARDCOORDD_TLS_CLIENT_CA", "tls_client_ca_file"},
    {"SHARDCOORD_LISTEN", "listen"},
    {"SHARDCOORD_HTTP_LISTEN", "http_listen"},
};

// Before the flags are applied: an old name stands for its new one unless that is set too.
void AdoptRenamedEnv(const std::string& old_name, const std::string& new_name) {
  const char* old_value = std::getenv(old_name.c_str());
  if (old_value == nullptr) return;
  auto log = shardcoord::logging::Get("coordinator");
  if (std::getenv(new_name.c_str()) != nullptr) {
    log->warn("{} is deprecated and ignored: {} is set too and wins; unset {}", old_name, new_name, old_name);
    return;
  }
  setenv(new_name.c_str(), old_value, 0);
  log->warn("{} is deprecated: rename it {} (read as that this time)", old_name, new_name);
}

// The newer old names first: where both are set, the newer one wins.
void AdoptRenamedEnv() {
  using shardcoord::coordinator::EnvName;
  for (const Setting& s : shardcoord::coordinator::Settings()) {
    if (s.env && s.renamed_from != nullptr) AdoptRenamedEnv(EnvName(s.renamed_from), EnvName(s.key));
  }
  for (const RenamedEnv& r : kRenamedEnv) AdoptRenamedEnv(r.old_name, EnvName(r.key));
}

// A SHARDCOORD_DAEMON_ variable that no setting reads (a typo, or a key without a variable)
// would be ignored silently: refused, naming the ones the daemon reads. False: said on stderr.
bool KnownDaemonEnvironment() {
  using shardcoord::coordinator::EnvName;
  std::set<std::string> known;
  for (const Setting& s : shardcoord::coordinator::Settings()) {
    if (!s.env) continue;
    known.insert(EnvName(s.key));
    if (s.renamed_from != nullptr) known.insert(EnvName(s.renamed_from));
  }
  for (const RenamedEnv& r : kRenamedEnv) known.insert(r.old_name);
  bool ok = true;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (name.rfind("SHARDCOORD_DAEMON_", 0) != 0 || known.count(name) > 0) continue;
    std::cerr << "shardcoordd: environment variable " << shardcoord::Printable(name, 64)
              << " is not one the daemon reads (" << absl::StrJoin(known, ", ")
              << "; every other setting is a flag or a config key): unset it or fix its name\n";
    ok = false;
  }
  return ok;
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
  if (!KnownDaemonEnvironment() || !ApplyFlags(f, options)) return 2;
  if (!shardcoord::logging::SetLevel(options.log_level)) {
    std::cerr << "shardcoordd: unknown log level '" << options.log_level
              << "'; use trace, debug, info, warn, error or off\n";
    return 2;
  }
  if (absl::Status s = shardcoord::coordinator::ValidateOptions(options); !s.ok()) {
    std::cerr << "shardcoordd: " << s.message() << "\n";
    return 2;
  }
  if (options.limits.max_outbox_bytes > options.limits.max_buffered_bytes) {
    shardcoord::logging::Get("coordinator")
        ->warn("max_outbox_bytes ({}) is above max_buffered_bytes ({}): the daemon-wide bound cuts a rank that "
               "does not read before its own bound can; lower max_outbox_bytes to mean it",
               options.limits.max_outbox_bytes, options.limits.max_buffered_bytes);
  }
  if (f.check_config) return CheckConfig(options, f.http_address_file);
  return Serve(options, f.http_address_file);
}
