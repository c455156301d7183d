#include "options.h"

#include <yaml-cpp/yaml.h>

#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardcoord::coordinator {

absl::Status ValidateOptions(const CoordinatorOptions& o) {
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
  if (o.default_policy == Policy::kUnspecified) {
    return absl::InvalidArgumentError("default policy must be auto, per_layer, root or replicate");
  }
  if (o.default_fallback == Fallback::kUnspecified) {
    return absl::InvalidArgumentError("default fallback must be root or replicate");
  }
  if (o.heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat interval must be > 0 ms");
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
  if (o.max_lookahead < 1) return absl::InvalidArgumentError("max lookahead must be >= 1");
  if (o.behind_threshold <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("behind threshold must be > 0 ms");
  }
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
  return absl::OkStatus();
}

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
      "log_level",        "address_file",      "behind_threshold_ms"};
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
    const YAML::Node& v = kv.second;
    try {
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
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": key '", key,
                                                     "' has a value of the wrong type (", e.what(),
                                                     ")"));
    }
  }
  return o;
}

}  // namespace shardcoord::coordinator
