// Configuration of the coordinator. Every field has a named default; shardcoordd fills
// it from an optional YAML file and then from flags (flags win). See README "shardcoordd
// configuration". Each setting an operator gives is one entry of settings.def: its field
// here, its YAML key, flag, help, type and range are written there once, and Settings()
// (below) is the table made from it.
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

// The daemon's settings are declared in settings.def, each once: its field (below, in the
// struct the entry names), its key and flag, its help and its range. The constants they
// default to come first.

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
// Longest duration any *_ms setting may have (24 h): durations travel to workers as int32 ms.
inline constexpr int64_t kMaxDurationMs = int64_t{24} * 3600 * 1000;
// The shortest heartbeat settings accepted (ValidateOptions).
inline constexpr absl::Duration kMinHeartbeatInterval = absl::Milliseconds(10);
inline constexpr absl::Duration kMinHeartbeatTimeout = absl::Milliseconds(100);
// The top of a range that has none.
inline constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();

// Each entry of settings.def for this struct becomes `Type Field = Default;`.
#define SHARDCOORD_SETTING_FIELD(Type, Field, Default, Key, Help, Rules) Type Field = Default;

// The daemon's TLS (tls.h): cert_file with key_file serve TLS only; client_ca_file set:
// callers must present a certificate it signed (mutual TLS).
struct TlsSettings {
#define TLS_SETTING SHARDCOORD_SETTING_FIELD
#include "coordinator/settings/settings.def"

  bool enabled() const { return !cert_file.empty(); }
  bool mutual() const { return !client_ca_file.empty(); }
};

// Bounds on what clients may make the daemon hold (rule: every bound is a setting, and a
// request over it is refused with RESOURCE_EXHAUSTED or INVALID_ARGUMENT naming it).
// Memory per job is O(world_size + modules x units); per group O(pending microbatches x
// modules x group size); per rank O(outbox); all buffers held for clients together at
// most max_buffered_bytes (plus 64 KiB per rank: a short queue is never refused).
// DESIGN 11.
struct CoordinatorLimits {
#define LIMIT_SETTING SHARDCOORD_SETTING_FIELD
#include "coordinator/settings/settings.def"
};

// `auto` promotion (DESIGN 3). Over the last `window` decided microbatches of a group,
// a module that the contract would gather (per_layer or root: some rank runs it) in at
// least `promote_threshold` of them is replicated from the next microbatch on, provided
// its parameter bytes fit the smallest memory_budget_bytes any member reported (0 there
// disables promotion): a resident replica needs no gather at all. A promoted module
// returns to per-microbatch decisions (freeing the replica) once the last `window`
// microbatches hold at most `demote_threshold` that would gather it. `by_cost`: once a
// group's members reported what a module costs, decide it by the estimated time.
struct PromotionOptions {
#define PROMOTION_SETTING SHARDCOORD_SETTING_FIELD
#include "coordinator/settings/settings.def"
};

// Most plans one PlanBatch may carry for a rank of lookahead `window` (the worker sends at
// most `window`; twice that plus 16 leaves room for plans of entries that failed locally).
// A bigger batch cuts the rank for breaking the protocol.
inline int MaxPlansPerBatch(int window) { return 2 * window + 16; }

struct CoordinatorOptions {
  // The settings: settings.def's DAEMON_SETTING entries (listen_address, heartbeat_interval,
  // ..., state_file), each with its comment there.
#define DAEMON_SETTING SHARDCOORD_SETTING_FIELD
#include "coordinator/settings/settings.def"

  PromotionOptions promotion;
  CoordinatorLimits limits;
  TlsSettings tls;

  // Not settings: set by the daemon at start.
  // The key of resume credentials and decision seals (LoadResumeKey, resume_auth.h);
  // empty: a random key of this process only (resumes after a restart unverified).
  std::string resume_key;
  // This process's incarnation (state_file.h); 0 in tests means 1.
  uint64_t incarnation = 0;
};

#undef SHARDCOORD_SETTING_FIELD

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
