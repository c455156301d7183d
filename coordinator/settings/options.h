// Configuration of the coordinator. Every field has a named default; shardcoordd fills
// it from an optional YAML file and then from flags (flags win). See README "shardcoordd
// configuration". Each setting an operator gives is one entry of Settings() (below): its
// YAML key, flag, help, type and range are written there once.
#ifndef SHARDCOORD_COORDINATOR_SETTINGS_OPTIONS_H_
#define SHARDCOORD_COORDINATOR_SETTINGS_OPTIONS_H_

#include <cstdint>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "shardcoord/types.h"

namespace shardcoord::coordinator {

struct TlsSettings {
  std::string cert_file;       // PEM certificate chain of the daemon; with key_file.
  std::string key_file;        // PEM private key; must not be readable by others.
  std::string client_ca_file;  // PEM CA bundle; set: callers must present a certificate it signed.
  absl::Duration reload_interval = absl::Seconds(60);

  bool enabled() const { return !cert_file.empty(); }
  bool mutual() const { return !client_ca_file.empty(); }
};

inline constexpr char kDefaultListenAddress[] = "127.0.0.1:7871";
inline constexpr absl::Duration kDefaultHeartbeatInterval = absl::Milliseconds(500);
inline constexpr absl::Duration kDefaultHeartbeatTimeout = absl::Seconds(5);
inline constexpr absl::Duration kDefaultPlanTimeout = absl::Seconds(300);
inline constexpr int kDefaultMaxLookahead = 64;
inline constexpr int kDefaultLookahead = 4;
inline constexpr int kDefaultPromoteWindow = 32;
inline constexpr int kDefaultPromoteThreshold = 8;
inline constexpr int kDefaultDemoteThreshold = 0;
inline constexpr int kDefaultEventCapacity = 10000;
inline constexpr int kDefaultDecisionHistory = 256;
inline constexpr absl::Duration kDefaultBehindThreshold = absl::Seconds(10);
// After a restart, how long a group waits for its members to resume (DESIGN 12).
inline constexpr absl::Duration kDefaultRecoveryWindow = absl::Seconds(60);
// Longest duration any *_ms setting may have: durations travel to workers as int32 ms.
inline constexpr absl::Duration kMaxDuration = absl::Hours(24);

// Bounds on what clients may make the daemon hold (rule: every bound is a setting, and a
// request over it is refused with RESOURCE_EXHAUSTED or INVALID_ARGUMENT naming it).
// Memory per job is O(world_size + modules x units); per group O(pending microbatches x
// modules x group size); per rank O(outbox); all buffers held for clients together at
// most max_buffered_bytes (plus 64 KiB per rank: a short queue is never refused).
// DESIGN 11.
struct CoordinatorLimits {
  int max_world_size = 65536;        // ranks in one job
  int max_total_ranks = 262144;      // ranks of all jobs held at once (a connected one: ~22 KB)
  int max_jobs = 1024;               // jobs held at once, finished ones included until evicted
  int max_modules = 1024;            // controlled modules in a manifest
  int max_units_per_module = 4096;   // layer units of one module
  int max_name_bytes = 256;          // job id, module and unit names, host name
  int max_pending_microbatches = 1024;  // per group: reported by some ranks, not yet by all
  int64_t max_outbox_bytes = 16 << 20;  // per rank: queued, not yet written to its stream (wire bytes)
  // Daemon-wide: memory held for clients across all sessions (buffer_budget.h): queued
  // messages (about 4x their wire size) and resumes waiting for their group. Past it, a rank
  // holding more than 64 KiB of queue is failed as not reading, and resumes are refused.
  int64_t max_buffered_bytes = int64_t{512} << 20;
  int max_communicators_per_job = 1024;  // named communicators one job may open
  // A communicator epoch's store: each value at most this big (Gloo addresses and NCCL ids
  // are small); at most 2 x members + 16 keys.
  int max_store_value_bytes = 64 << 10;
  // A job with no live rank is forgotten this long after its last rank left or died.
  absl::Duration job_retention = absl::Minutes(10);
  // A connection that has not finished the HTTP/2 handshake by then is closed, and so is a
  // Session stream that has not sent its registration.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // The daemon checks this often that its listener still accepts connections (it stops
  // after descriptor exhaustion in gRPC 1.51); 0 disables the check.
  absl::Duration self_check_interval = absl::Seconds(5);
};

// `auto` promotion (DESIGN 3). Over the last `window` decided microbatches of a group,
// a module that the contract would gather (per_layer or root: some rank runs it) in at
// least `promote_threshold` of them is replicated from the next microbatch on, provided
// its parameter bytes fit the smallest memory_budget_bytes any member reported (0 there
// disables promotion): a resident replica needs no gather at all. A promoted module
// returns to per-microbatch decisions (freeing the replica) once the last `window`
// microbatches hold at most `demote_threshold` that would gather it.
struct PromotionOptions {
  int window = kDefaultPromoteWindow;
  int promote_threshold = kDefaultPromoteThreshold;
  int demote_threshold = kDefaultDemoteThreshold;
  // Cost-aware `auto` (DESIGN 3): once a group's members reported what a module costs, decide
  // it by the estimated time within the budget; false: by counting alone, whatever they report.
  bool by_cost = true;
};

// Most plans one PlanBatch may carry for a rank of lookahead `window` (the worker sends at
// most `window`; twice that plus 16 leaves room for plans of entries that failed locally).
// A bigger batch cuts the rank for breaking the protocol.
inline int MaxPlansPerBatch(int window) { return 2 * window + 16; }

// The shortest heartbeat settings accepted (ValidateOptions).
inline constexpr absl::Duration kMinHeartbeatInterval = absl::Milliseconds(10);
inline constexpr absl::Duration kMinHeartbeatTimeout = absl::Milliseconds(100);

struct CoordinatorOptions {
  std::string listen_address = kDefaultListenAddress;
  Policy default_policy = Policy::kAuto;
  Fallback default_fallback = Fallback::kRoot;
  // Told to workers at registration; they heartbeat at this interval.
  absl::Duration heartbeat_interval = kDefaultHeartbeatInterval;
  // A live rank silent for this long is declared dead.
  absl::Duration heartbeat_timeout = kDefaultHeartbeatTimeout;
  // A microbatch some ranks of a group planned but others never did fails after this.
  absl::Duration plan_timeout = kDefaultPlanTimeout;
  // Largest lookahead a rank may register; 0 in a registration means kDefaultLookahead.
  int max_lookahead = kDefaultMaxLookahead;
  // Members of a communicator blocked in a collective this long, while another member has
  // not issued it, make the coordinator name that member as behind.
  absl::Duration behind_threshold = kDefaultBehindThreshold;
  PromotionOptions promotion;
  CoordinatorLimits limits;
  int event_capacity = kDefaultEventCapacity;      // Events kept for `shardctl events`.
  int decision_history = kDefaultDecisionHistory;  // Decisions kept per group.
  std::string log_level = "info";
  // When set, the bound address is written here once serving (for --listen ...:0).
  std::string address_file;
  // After a restart, a group whose members have not all resumed within this window fails,
  // naming the missing ones (DESIGN 12).
  absl::Duration recovery_window = kDefaultRecoveryWindow;
  // Optional file keeping the incarnation across restarts (never needed for correctness);
  // its companion <state_file>.key keeps the resume key (resume_auth.h).
  std::string state_file;
  // The key of resume credentials and decision seals (resume_auth.h), loaded by the daemon at
  // start; empty: a random key of this process only (resumes after a restart unverified).
  std::string resume_key;
  // Tokens with roles (auth.h); empty: no tokens, and then only loopback unless `insecure`.
  std::string token_file;
  // TLS (tls.h); without it the daemon serves plaintext, and then only loopback unless
  // `insecure`.
  TlsSettings tls;
  bool insecure = false;  // Serve other addresses without TLS or tokens (a loud warning).
  // HOST:PORT of the HTTP status page, /metrics and /healthz (http_server.h); empty: off.
  // Beyond loopback, the same rule as `listen_address`: TLS and tokens, or `insecure`.
  std::string http_listen;
  // Bounds of that listener (http_server.h): connections open at once (more are closed at
  // accept), and the time one exchange (TLS handshake, request, response) may take.
  int http_max_connections = 64;
  absl::Duration http_request_timeout = absl::Seconds(5);
  // /metrics gives series per rank (heartbeat age) and per group (epoch, pending) only for
  // jobs of at most this many ranks (metrics.h); larger jobs get per-job series only.
  // 0: none.
  int metrics_rank_series_max = 256;
  // SQLite file keeping every event across restarts (event_journal.h); empty: memory only.
  std::string journal_file;
  absl::Duration journal_retention = absl::Hours(24 * 7);  // Older events are deleted.
  int64_t journal_max_events = 1000000;                    // And all but the newest this many.
  // Threads serving the rank Session streams, each with its own completion queue (DESIGN 9);
  // 0: one per online CPU (std::thread::hardware_concurrency: the machine's, not the
  // process's CPU affinity).
  int session_threads = 0;
  // This process's incarnation: set by the daemon at start (state_file.h); 0 in tests means 1.
  uint64_t incarnation = 0;
};

// ---------------------------------------------------------------------------------------
// The settings table. One entry per setting an operator gives; the config file's keys
// (LoadConfigFile), shardcoordd's flags with their help and environment variables (its
// main) and the range checks (ValidateOptions) are all made from it, so that a new setting
// is one entry and its key and flag cannot drift apart. Checks that relate two settings
// (timeout >= 2 x interval, ...) are written out after the table, in ValidateOptions.

// The field a setting fills, as a function returning it: a member pointer of
// CoordinatorOptions cannot reach the fields of its nested structs (limits, promotion, tls).
template <typename T>
using SettingField = T& (*)(CoordinatorOptions&);

// The field's type says how its value is written: text (paths, addresses), a switch (true
// or false; its flag takes no value), a whole number, a duration as a whole number of the
// unit its key ends with (_ms, _s, _hours), or a policy or fallback by name.
using AnySettingField = std::variant<SettingField<std::string>, SettingField<bool>, SettingField<int>,
                                     SettingField<int64_t>, SettingField<absl::Duration>, SettingField<Policy>,
                                     SettingField<Fallback>>;

inline constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();

struct Setting {
  Setting(const char* key, AnySettingField field, const char* help) : key(key), field(field), help(help) {}

  // The YAML key. The flag is the same name with dashes (FlagName), and a setting read from
  // the environment too is SHARDCOORD_DAEMON_<KEY> (EnvName).
  const char* key;
  AnySettingField field;
  const char* help;  // The flag's help; README "shardcoordd configuration" says more.
  // Numbers and durations (in the key's unit): the accepted range.
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = kUnbounded;
  // Text: the accepted values when not empty (a policy or fallback: always its names).
  std::vector<std::string> choices;
  // Text: why a value is refused, "" when it is fine: for what a range cannot say (HOST:PORT).
  std::string (*check)(const std::string& value) = nullptr;
  // Also read from EnvName(key), over the config file and under the flag: for what a unit
  // or container gives per host (addresses, the secrets' paths).
  bool env = false;
  // The flag's name before it became the key's (in key form, "tls_cert": --tls-cert, and
  // $SHARDCOORD_DAEMON_TLS_CERT); still accepted, with one deprecation line. nullptr: none.
  const char* renamed_from = nullptr;

  // For writing the table: Setting(key, field, help).Range(1, kUnbounded).Env() ...
  Setting& Range(int64_t lo, int64_t hi);
  Setting& Choices(std::vector<std::string> values);
  Setting& Check(std::string (*why_refused)(const std::string& value));
  Setting& Env();
  Setting& RenamedFrom(const char* old_key);
};

// Every setting, in the order of README's table (and of --help).
const std::vector<Setting>& Settings();
// The setting of a YAML key, or nullptr.
const Setting* FindSetting(absl::string_view key);

// "--" and the key with dashes: FlagName("tls_cert_file") is "--tls-cert-file".
std::string FlagName(absl::string_view key);
// SHARDCOORD_DAEMON_ and the key in capitals: SHARDCOORD_DAEMON_TLS_CERT_FILE.
std::string EnvName(absl::string_view key);
// How messages name a setting: "config key tls_cert_file, flag --tls-cert-file" (and its
// environment variable where it has one).
std::string SettingNames(const Setting& setting);

// The names a setting accepts (its choices, or the policies'); empty: any text or number.
std::vector<std::string> SettingChoices(const Setting& setting);
// Whether a setting is a switch (true or false): its flag takes no value.
bool IsSwitch(const Setting& setting);
// What a setting's value is, for --help: TEXT, INT, MS, S, HOURS or BOOL.
std::string ValueTypeName(const Setting& setting);

// A setting's value as written in YAML or after its flag ("500" for 500 ms).
std::string SettingValueText(const Setting& setting, const CoordinatorOptions& options);
// Sets a setting from its written value (a YAML scalar, a flag's argument). The message of
// an error says what is wrong with the value ("'abc' is of the wrong type (a whole number of
// ms expected)"); the caller says where it came from. Ranges are ValidateOptions' part.
absl::Status SetFromText(const Setting& setting, const std::string& text, CoordinatorOptions& options);

// Whether HOST:PORT names a loopback address (127.0.0.0/8, [::1], localhost).
bool IsLoopbackAddress(const std::string& listen_address);

// Checks each setting's range (the table) and then the relations between settings
// (timeout >= 2 x interval, ...). The message names the settings by key and by flag.
absl::Status ValidateOptions(const CoordinatorOptions& options);

// Reads a YAML config file over `base`. Unknown keys are errors (typos must not pass
// silently); the message names the file, the key and the accepted keys.
absl::StatusOr<CoordinatorOptions> LoadConfigFile(const std::string& path,
                                                  CoordinatorOptions base = {});

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SETTINGS_OPTIONS_H_
