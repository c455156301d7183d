#include "trace.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "json_values.h"

namespace shardcoord::client {

using nlohmann::json;

namespace {

// Whether `v` is an integer in [0, max] (json_values.h).
bool IntegerIn(const json& v, int64_t max) { return JsonIntegerIn(v, 0, max); }

// Checks the fields of one trace line: rank, step and microbatch present and in range, and
// no field but those and calls. `where` starts each error.
absl::Status CheckFields(const json& j, const std::string& where) {
  for (const char* field : {"rank", "step", "microbatch"}) {
    // step is 64-bit; rank and microbatch are 32-bit on the wire.
    const int64_t max = std::string(field) == "step" ? INT64_MAX : INT32_MAX;
    if (!j.contains(field) || !IntegerIn(j[field], max)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "'", field, "' must be a non-negative integer (at most ", max, ")"));
    }
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "rank" && it.key() != "step" && it.key() != "microbatch" && it.key() != "calls" &&
        it.key() != "tokens") {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "unknown field '", it.key(), "' (fields: rank, step, microbatch, calls, tokens)"));
    }
  }
  return absl::OkStatus();
}

// The line's "tokens" (nullopt when absent): a non-negative integer up to kMaxTraceTokens.
absl::StatusOr<std::optional<int64_t>> ParseTokens(const json& j, const std::string& where) {
  if (!j.contains("tokens")) return std::optional<int64_t>();
  const json& v = j["tokens"];
  if (!IntegerIn(v, kMaxTraceTokens)) {
    return absl::InvalidArgumentError(absl::StrCat(where, "'tokens' must be a non-negative integer (the decoder tokens "
                                                   "of the rank's microbatch, at most ", kMaxTraceTokens, "), got ",
                                                   JsonShown(v)));
  }
  return std::optional<int64_t>(v.get<int64_t>());
}

// The line's "calls" (module -> count; none when absent); adds their modules to the trace's.
absl::StatusOr<std::map<std::string, int32_t>> ParseCalls(const json& j, const std::string& where, Trace* trace) {
  std::map<std::string, int32_t> calls;
  if (!j.contains("calls")) return calls;
  if (!j["calls"].is_object()) {
    return absl::InvalidArgumentError(where + "'calls' must be an object of module -> count");
  }
  for (auto it = j["calls"].begin(); it != j["calls"].end(); ++it) {
    if (!IntegerIn(it.value(), INT32_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "calls of module '", it.key(), "' must be a non-negative integer (at most ", INT32_MAX, ")"));
    }
    calls[it.key()] = it.value().get<int32_t>();
    trace->module_names.insert(it.key());
  }
  return calls;
}

// Adds one (not blank) line of a trace; returns whether it gave "tokens". `where` starts each
// error.
absl::StatusOr<bool> AddLine(const std::string& line, const std::string& where, Trace* trace) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, "not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(where + "each line must be a JSON object");
  if (absl::Status s = CheckFields(j, where); !s.ok()) return s;
  const int rank = j["rank"].get<int>();
  const MicrobatchKey key{j["step"].get<int64_t>(), j["microbatch"].get<int32_t>()};
  absl::StatusOr<std::map<std::string, int32_t>> calls = ParseCalls(j, where, trace);
  if (!calls.ok()) return calls.status();
  absl::StatusOr<std::optional<int64_t>> tokens = ParseTokens(j, where);
  if (!tokens.ok()) return tokens.status();
  auto& per_rank = trace->plans[rank];
  if (per_rank.count(key)) {
    return absl::InvalidArgumentError(absl::StrCat(where, "rank ", rank, " microbatch ",
                                                   key.ToString(), " appears twice"));
  }
  per_rank[key] = std::move(*calls);
  if (tokens->has_value()) trace->tokens[rank][key] = **tokens;
  trace->keys.insert(key);
  trace->max_rank = std::max(trace->max_rank, rank);
  return tokens->has_value();
}

// A trace gives tokens on every line or on none: a line that differs from the first one is an
// error naming both (a trace with holes would be priced per token in some microbatches only).
absl::Status CheckTokensAlike(bool has_tokens, int first_lineno, bool first_has_tokens, const std::string& where) {
  if (has_tokens == first_has_tokens) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      where, has_tokens ? "'tokens' is given, but line " : "'tokens' is missing, but line ", first_lineno,
      has_tokens ? " has none" : " gives it", ": give every line its microbatch's tokens, or none"));
}

}  // namespace

absl::StatusOr<Trace> ParseTrace(std::istream& in, const std::string& source) {
  Trace trace;
  std::string line;
  int lineno = 0, first_lineno = 0;
  bool first_has_tokens = false;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(source, ":", lineno, ": ");
    absl::StatusOr<bool> has_tokens = AddLine(line, where, &trace);
    if (!has_tokens.ok()) return has_tokens.status();
    if (first_lineno == 0) {
      first_lineno = lineno;
      first_has_tokens = *has_tokens;
    }
    if (absl::Status s = CheckTokensAlike(*has_tokens, first_lineno, first_has_tokens, where); !s.ok()) {
      return s;
    }
  }
  if (trace.keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": the trace holds no microbatch"));
  }
  return trace;
}

namespace {

// The "param_bytes" of a module or unit (0 when absent): a non-negative integer. A number
// past int64 (which the JSON library holds as a double) or with a fraction is refused, not
// cast. `where` starts the error.
absl::StatusOr<int64_t> ParamBytes(const json& entry, const std::string& where) {
  if (!entry.contains("param_bytes")) return 0;
  const json& v = entry["param_bytes"];
  if (!IntegerIn(v, INT64_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": 'param_bytes' must be a non-negative integer (bytes, at most ", INT64_MAX, "), got ", JsonShown(v)));
  }
  return v.get<int64_t>();
}

// One entry of a manifest's "modules". `where` starts each error.
absl::StatusOr<ModuleSpec> ParseModule(const json& m, const std::string& where) {
  if (!m.is_object() || !m.contains("name") || !m["name"].is_string()) {
    return absl::InvalidArgumentError(where + " needs a string 'name'");
  }
  ModuleSpec spec;
  spec.name = m["name"].get<std::string>();
  const std::string named = absl::StrCat(where, " ('", spec.name, "')");
  absl::StatusOr<int64_t> bytes = ParamBytes(m, named);
  if (!bytes.ok()) return bytes.status();
  spec.param_bytes = *bytes;
  try {
    spec.outside_inner_root = m.value("outside_inner_root", false);
    spec.trainable = m.value("trainable", false);
    if (m.contains("units")) {
      for (const json& u : m["units"]) {
        if (!u.is_object() || !u.contains("name") || !u["name"].is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              named, ": each unit must be {\"name\": \"layers.0\", \"param_bytes\": N}"));
        }
        const std::string unit = u["name"].get<std::string>();
        absl::StatusOr<int64_t> unit_bytes = ParamBytes(u, absl::StrCat(named, ", unit '", unit, "'"));
        if (!unit_bytes.ok()) return unit_bytes.status();
        spec.units.push_back({unit, *unit_bytes});
      }
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, " ('", spec.name, "'): ", e.what()));
  }
  return spec;
}

}  // namespace

absl::StatusOr<std::vector<ModuleSpec>> ParseManifest(const std::string& text,
                                                      const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object() || !j.contains("modules") || !j["modules"].is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected {\"modules\": [{\"name\": ..., \"param_bytes\": ...}]}"));
  }
  std::vector<ModuleSpec> out;
  for (size_t i = 0; i < j["modules"].size(); ++i) {
    absl::StatusOr<ModuleSpec> spec = ParseModule(j["modules"][i], absl::StrCat(source, ": modules[", i, "]"));
    if (!spec.ok()) return spec.status();
    out.push_back(std::move(*spec));
  }
  return out;
}

}  // namespace shardcoord::client
