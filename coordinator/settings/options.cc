#include "coordinator/settings/options.h"

#include <yaml-cpp/yaml.h>

#include <set>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardcoord::coordinator {

// ---------------------------------------------------------------------------------------
// The table

Setting& Setting::Range(int64_t lo, int64_t hi) {
  min = lo;
  max = hi;
  return *this;
}

Setting& Setting::Choices(std::vector<std::string> values) {
  choices = std::move(values);
  return *this;
}

Setting& Setting::Check(std::string (*why_refused)(const std::string& value)) {
  check = why_refused;
  return *this;
}

Setting& Setting::Env() {
  env = true;
  return *this;
}

Setting& Setting::RenamedFrom(const char* old_key) {
  renamed_from = old_key;
  return *this;
}

namespace {

// The field `path` of CoordinatorOptions as a SettingField (options.h says why not a member
// pointer). The unary + makes the lambda the plain function pointer the variant holds.
#define OPTION_FIELD(path) (+[](CoordinatorOptions& o) -> auto& { return o.path; })

// Why HOST:PORT is not one ("" when it is): the gRPC listener takes nothing else.
std::string ListenProblem(const std::string& a) {
  const size_t colon = a.rfind(':');
  int port = -1;
  const bool ok = colon != std::string::npos && colon > 0 && absl::SimpleAtoi(a.substr(colon + 1), &port) &&
                  port >= 0 && port <= 65535 &&
                  a.substr(colon + 1).find_first_not_of("0123456789") == std::string::npos;
  return ok ? "" : "is not HOST:PORT with a port in 0..65535, such as 127.0.0.1:7871, 0.0.0.0:7871 or [::]:7871 "
                   "(port 0 picks a free one)";
}

// The HTTP listener is off when empty.
std::string HttpListenProblem(const std::string& a) {
  return a.empty() || a.rfind(':') != std::string::npos ? "" : "is not HOST:PORT";
}

// The table: every entry of settings.def as a Setting, in its order. Rules is the entry's
// chain of builders (.Range(...).Env() ...), empty for none.
std::vector<Setting> MakeSettings() {
#define DAEMON_SETTING(Type, Field, Default, Key, Help, Rules) Setting(Key, OPTION_FIELD(Field), Help) Rules,
#define LIMIT_SETTING(Type, Field, Default, Key, Help, Rules) Setting(Key, OPTION_FIELD(limits.Field), Help) Rules,
#define PROMOTION_SETTING(Type, Field, Default, Key, Help, Rules) \
  Setting(Key, OPTION_FIELD(promotion.Field), Help) Rules,
#define TLS_SETTING(Type, Field, Default, Key, Help, Rules) Setting(Key, OPTION_FIELD(tls.Field), Help) Rules,
  return {
#include "coordinator/settings/settings.def"
  };
}

#undef OPTION_FIELD

// A duration's unit, from the ending of its key.
struct Unit {
  absl::Duration size;
  const char* name;  // As messages write it.
  const char* type;  // As --help writes it.
};

Unit UnitOf(const Setting& s) {
  const absl::string_view key = s.key;
  if (absl::EndsWith(key, "_ms")) return {absl::Milliseconds(1), "ms", "MS"};
  if (absl::EndsWith(key, "_hours")) return {absl::Hours(1), "h", "HOURS"};
  return {absl::Seconds(1), "s", "S"};  // "_s": the table test checks that every duration key has a unit.
}

bool IsDuration(const Setting& s) { return std::holds_alternative<SettingField<absl::Duration>>(s.field); }

// How messages describe a setting in words: its key without the unit, with spaces
// ("heartbeat interval"); SettingNames then says which key and flag set it.
std::string Described(const Setting& s) {
  std::string name = s.key;
  if (IsDuration(s)) name = name.substr(0, name.rfind('_'));
  std::replace(name.begin(), name.end(), '_', ' ');
  return name;
}

// What a value of the setting looks like, for a value of the wrong type.
std::string Expected(const Setting& s) {
  const std::vector<std::string> choices = SettingChoices(s);
  if (!choices.empty()) return absl::StrCat("one of ", absl::StrJoin(choices, ", "));
  if (IsSwitch(s)) return "true or false";
  if (IsDuration(s)) return absl::StrCat("a whole number of ", UnitOf(s).name);
  if (std::holds_alternative<SettingField<std::string>>(s.field)) return "text";
  return "a whole number";
}

absl::Status WrongType(const Setting& s, const std::string& text) {
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "' is of the wrong type (", Expected(s), " expected)"));
}

absl::Status NotAChoice(const Setting& s, const std::string& text) {
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "' is not one of ", absl::StrJoin(SettingChoices(s), ", ")));
}

}  // namespace

const std::vector<Setting>& Settings() {
  static const std::vector<Setting> table = MakeSettings();
  return table;
}

const Setting* FindSetting(absl::string_view key) {
  for (const Setting& s : Settings()) {
    if (key == s.key) return &s;
  }
  return nullptr;
}

std::string FlagName(absl::string_view key) {
  std::string flag = absl::StrCat("--", key);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

std::string EnvName(absl::string_view key) { return absl::StrCat("SHARDCOORD_DAEMON_", absl::AsciiStrToUpper(key)); }

std::string SettingNames(const Setting& s) {
  return absl::StrCat("config key ", s.key, ", flag ", FlagName(s.key),
                      s.env ? absl::StrCat(", environment ", EnvName(s.key)) : "");
}

std::vector<std::string> SettingChoices(const Setting& s) {
  if (std::holds_alternative<SettingField<Policy>>(s.field)) return PolicyNames();
  if (std::holds_alternative<SettingField<Fallback>>(s.field)) return FallbackNames();
  return s.choices;
}

bool IsSwitch(const Setting& s) { return std::holds_alternative<SettingField<bool>>(s.field); }

std::string ValueTypeName(const Setting& s) {
  if (IsSwitch(s)) return "BOOL";
  if (IsDuration(s)) return UnitOf(s).type;
  if (std::holds_alternative<SettingField<int>>(s.field) || std::holds_alternative<SettingField<int64_t>>(s.field)) {
    return "INT";
  }
  return "TEXT";
}

// ---------------------------------------------------------------------------------------
// Values as text: a YAML scalar or a flag's argument, parsed one way for both.

namespace {

absl::Status Parse(const Setting& s, const std::string& text, std::string& out) {
  if (!s.choices.empty() && std::find(s.choices.begin(), s.choices.end(), text) == s.choices.end()) {
    return NotAChoice(s, text);
  }
  out = text;
  return absl::OkStatus();
}

// YAML 1.1's words for a boolean, as yaml-cpp took them before the table.
absl::Status Parse(const Setting& s, const std::string& text, bool& out) {
  const std::string word = absl::AsciiStrToLower(text);
  if (word == "true" || word == "yes" || word == "on") {
    out = true;
  } else if (word == "false" || word == "no" || word == "off") {
    out = false;
  } else {
    return WrongType(s, text);
  }
  return absl::OkStatus();
}

absl::Status Parse(const Setting& s, const std::string& text, int64_t& out) {
  // Digits only: SimpleAtoi takes " 5" (a quoted value with a space) as 5.
  if (text.empty() || absl::ascii_isspace(static_cast<unsigned char>(text.front())) ||
      absl::ascii_isspace(static_cast<unsigned char>(text.back()))) {
    return WrongType(s, text);
  }
  return absl::SimpleAtoi(text, &out) ? absl::OkStatus() : WrongType(s, text);
}

absl::Status Parse(const Setting& s, const std::string& text, int& out) {
  int64_t wide = 0;
  if (absl::Status st = Parse(s, text, wide); !st.ok()) return st;
  if (wide < std::numeric_limits<int>::min() || wide > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is out of range (at most ",
                                                   std::numeric_limits<int>::max(), ")"));
  }
  out = static_cast<int>(wide);
  return absl::OkStatus();
}

absl::Status Parse(const Setting& s, const std::string& text, absl::Duration& out) {
  int64_t count = 0;
  if (absl::Status st = Parse(s, text, count); !st.ok()) return st;
  out = count * UnitOf(s).size;
  return absl::OkStatus();
}

absl::Status Parse(const Setting& s, const std::string& text, Policy& out) {
  std::optional<Policy> p = ParsePolicy(text);
  if (!p) return NotAChoice(s, text);
  out = *p;
  return absl::OkStatus();
}

absl::Status Parse(const Setting& s, const std::string& text, Fallback& out) {
  std::optional<Fallback> f = ParseFallback(text);
  if (!f) return NotAChoice(s, text);
  out = *f;
  return absl::OkStatus();
}

std::string Text(const Setting&, const std::string& v) { return v; }
std::string Text(const Setting&, bool v) { return v ? "true" : "false"; }
std::string Text(const Setting&, int64_t v) { return absl::StrCat(v); }
std::string Text(const Setting&, int v) { return absl::StrCat(v); }
std::string Text(const Setting& s, absl::Duration v) {
  absl::Duration rest;  // Below one unit: not written (a duration set in code, not from text).
  return absl::StrCat(absl::IDivDuration(v, UnitOf(s).size, &rest));
}
std::string Text(const Setting&, Policy v) { return PolicyName(v); }
std::string Text(const Setting&, Fallback v) { return FallbackName(v); }

// The table's functions give mutable fields, for parsing and checking alike; checking only
// reads through them.
CoordinatorOptions& ForReading(const CoordinatorOptions& o) { return const_cast<CoordinatorOptions&>(o); }

}  // namespace

std::string SettingValueText(const Setting& s, const CoordinatorOptions& o) {
  return std::visit([&](auto field) { return Text(s, field(ForReading(o))); }, s.field);
}

absl::Status SetFromText(const Setting& s, const std::string& text, CoordinatorOptions& o) {
  return std::visit([&](auto field) { return Parse(s, text, field(o)); }, s.field);
}

// ---------------------------------------------------------------------------------------
// ValidateOptions: each setting's range from the table, then the relations between them.

namespace {

// A bound as messages write it: in the key's unit, and in hours too where that is shorter
// ("24 h = 86400000 ms").
std::string BoundText(const Setting& s, int64_t bound) {
  if (!IsDuration(s)) return absl::StrCat(bound);
  const Unit unit = UnitOf(s);
  const absl::Duration d = bound * unit.size;
  if (unit.size < absl::Hours(1) && d >= absl::Hours(1) && d % absl::Hours(1) == absl::ZeroDuration()) {
    return absl::StrCat(absl::ToInt64Hours(d), " h = ", bound, " ", unit.name);
  }
  return absl::StrCat(bound, " ", unit.name);
}

absl::Status Refused(const Setting& s, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(Described(s), " ", what, " (", SettingNames(s), ")"));
}

// `shown` is the value as messages write it ("5 ms"); `below`: under the minimum, else over
// the maximum.
absl::Status OutOfRange(const Setting& s, const std::string& shown, bool below) {
  return Refused(s, absl::StrCat("(", shown, ") must be at ", below ? "least " : "most ",
                                 BoundText(s, below ? s.min : s.max)));
}

absl::Status CheckValue(const Setting& s, const std::string& v) {
  if (!s.choices.empty() && std::find(s.choices.begin(), s.choices.end(), v) == s.choices.end()) {
    return Refused(s, absl::StrCat("'", v, "' is not one of ", absl::StrJoin(s.choices, ", ")));
  }
  if (s.check != nullptr) {
    if (std::string why = s.check(v); !why.empty()) return Refused(s, absl::StrCat("'", v, "' ", why));
  }
  return absl::OkStatus();
}

absl::Status CheckValue(const Setting&, bool) { return absl::OkStatus(); }

absl::Status CheckValue(const Setting& s, int64_t v) {
  if (v < s.min || v > s.max) return OutOfRange(s, absl::StrCat(v), v < s.min);
  return absl::OkStatus();
}

absl::Status CheckValue(const Setting& s, int v) { return CheckValue(s, int64_t{v}); }

// Compared as durations, so that a value between two whole units is not rounded into range.
absl::Status CheckValue(const Setting& s, absl::Duration v) {
  const Unit unit = UnitOf(s);
  const bool below = v < s.min * unit.size;
  if (below || (s.max != kUnbounded && v > s.max * unit.size)) {
    return OutOfRange(s, absl::StrCat(Text(s, v), " ", unit.name), below);
  }
  return absl::OkStatus();
}

// A policy or fallback the options hold but no name gives (kUnspecified, set in code).
template <typename Enum>
absl::Status CheckNamed(const Setting& s, Enum v) {
  const std::vector<std::string> choices = SettingChoices(s);
  const std::string name = Text(s, v);
  if (std::find(choices.begin(), choices.end(), name) != choices.end()) return absl::OkStatus();
  return Refused(s, absl::StrCat("'", name, "' is not one of ", absl::StrJoin(choices, ", ")));
}

absl::Status CheckValue(const Setting& s, Policy v) { return CheckNamed(s, v); }
absl::Status CheckValue(const Setting& s, Fallback v) { return CheckNamed(s, v); }

// Beyond loopback, listeners need TLS and tokens unless the operator accepts the risk.
absl::Status CheckExposure(const CoordinatorOptions& o) {
  const bool secured = !o.token_file.empty() && o.tls.enabled();
  if (!o.insecure && !secured && !IsLoopbackAddress(o.listen_address)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address ", o.listen_address, " is not loopback, and without ",
        o.token_file.empty() ? "a token file anyone who reaches it can act for any rank"
                             : "TLS the tokens travel in clear text",
        ": give --token-file and --tls-cert-file/--tls-key-file (see README, Security), or --insecure to accept "
        "that"));
  }
  if (!o.insecure && !secured && !o.http_listen.empty() && !IsLoopbackAddress(o.http_listen)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "http_listen ", o.http_listen,
        " is not loopback: give --token-file and --tls-cert-file/--tls-key-file (the page and /metrics then need "
        "a read token, over HTTPS), or --insecure to accept that"));
  }
  return absl::OkStatus();
}

// The checks that relate settings to each other; each is within its own range already.
absl::Status CheckRelations(const CoordinatorOptions& o) {
  if (absl::Status s = CheckExposure(o); !s.ok()) return s;
  if (o.heartbeat_timeout < 2 * o.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat timeout (", absl::ToInt64Milliseconds(o.heartbeat_timeout),
        " ms) must be at least twice the heartbeat interval (", absl::ToInt64Milliseconds(o.heartbeat_interval),
        " ms): heartbeat_timeout_ms >= 2 x heartbeat_interval_ms (flags --heartbeat-timeout-ms, "
        "--heartbeat-interval-ms)"));
  }
  if (o.limits.max_world_size > o.limits.max_total_ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_world_size (", o.limits.max_world_size, ") is above max_total_ranks (", o.limits.max_total_ranks,
        "): a job of that size could never be admitted; lower max_world_size or raise max_total_ranks (flags "
        "--max-world-size, --max-total-ranks)"));
  }
  const PromotionOptions& p = o.promotion;
  if (p.promote_threshold > p.window || p.demote_threshold >= p.promote_threshold) {
    return absl::InvalidArgumentError(absl::StrCat(
        "promotion settings need 1 <= promote_threshold <= promote_window and 0 <= demote_threshold < "
        "promote_threshold (flags --promote-threshold, --promote-window, --demote-threshold), got promote_window ",
        p.window, ", promote_threshold ", p.promote_threshold, ", demote_threshold ", p.demote_threshold));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsLoopbackAddress(const std::string& listen_address) {
  const size_t colon = listen_address.rfind(':');
  std::string host = colon == std::string::npos ? listen_address : listen_address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

absl::Status ValidateOptions(const CoordinatorOptions& o) {
  for (const Setting& s : Settings()) {
    absl::Status st = std::visit([&](auto field) { return CheckValue(s, field(ForReading(o))); }, s.field);
    if (!st.ok()) return st;
  }
  return CheckRelations(o);
}

// ---------------------------------------------------------------------------------------
// LoadConfigFile

namespace {

// Sorted, as an unknown key's message lists them (scripts/check-deploy.sh reads that list).
std::string AcceptedKeys() {
  std::vector<std::string> keys;
  for (const Setting& s : Settings()) keys.emplace_back(s.key);
  std::sort(keys.begin(), keys.end());
  return absl::StrJoin(keys, ", ");
}

// One key's value into the options: a scalar is read as the same text after the flag would
// be; an empty value (`key:`) is empty text.
absl::Status ApplyConfigValue(const std::string& path, const Setting& s, const YAML::Node& v,
                              CoordinatorOptions& o) {
  std::string text;
  if (v.IsScalar()) {
    text = v.Scalar();
  } else if (!v.IsNull() || !std::holds_alternative<SettingField<std::string>>(s.field)) {
    const char* what = v.IsSequence() ? "a list" : v.IsMap() ? "a mapping" : "an empty value";
    return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": ", s.key, " has ", what,
                                                   ", a value of the wrong type (", Expected(s), " expected)"));
  }
  if (absl::Status st = SetFromText(s, text, o); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": ", s.key, " ", st.message()));
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
  std::set<std::string> seen;
  for (const auto& kv : root) {
    if (!kv.first.IsScalar()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config file ", path, ": every key must be a plain name; accepted keys: ", AcceptedKeys()));
    }
    const std::string key = kv.first.Scalar();
    if (!seen.insert(key).second) {  // yaml-cpp keeps both; which one wins would be an accident.
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": key '", key,
                                                     "' is given twice; keep one"));
    }
    const Setting* s = FindSetting(key);
    if (s == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("config file ", path, ": unknown key '", key, "'; accepted keys: ", AcceptedKeys()));
    }
    if (absl::Status st = ApplyConfigValue(path, *s, kv.second, o); !st.ok()) return st;
  }
  return o;
}

}  // namespace shardcoord::coordinator
