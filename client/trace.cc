#include "trace.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardcoord::client {

using nlohmann::json;

namespace {

// Checks the fields of one trace line: rank, step and microbatch present and in range, and
// no field but those and calls. `where` starts each error.
absl::Status CheckFields(const json& j, const std::string& where) {
  for (const char* field : {"rank", "step", "microbatch"}) {
    // step is 64-bit; rank and microbatch are 32-bit on the wire.
    const int64_t max = std::string(field) == "step" ? INT64_MAX : INT32_MAX;
    if (!j.contains(field) || !j[field].is_number_integer() || j[field].get<int64_t>() < 0 ||
        (j[field].is_number_unsigned() && j[field].get<uint64_t>() > static_cast<uint64_t>(max)) ||
        j[field].get<int64_t>() > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "'", field, "' must be a non-negative integer (at most ", max, ")"));
    }
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "rank" && it.key() != "step" && it.key() != "microbatch" && it.key() != "calls") {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "unknown field '", it.key(), "' (fields: rank, step, microbatch, calls)"));
    }
  }
  return absl::OkStatus();
}

// The line's "calls" (module -> count; none when absent); adds their modules to the trace's.
absl::StatusOr<std::map<std::string, int32_t>> ParseCalls(const json& j, const std::string& where, Trace* trace) {
  std::map<std::string, int32_t> calls;
  if (!j.contains("calls")) return calls;
  if (!j["calls"].is_object()) {
    return absl::InvalidArgumentError(where + "'calls' must be an object of module -> count");
  }
  for (auto it = j["calls"].begin(); it != j["calls"].end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "calls of module '", it.key(), "' must be a non-negative integer (at most ", INT32_MAX, ")"));
    }
    calls[it.key()] = it.value().get<int32_t>();
    trace->module_names.insert(it.key());
  }
  return calls;
}

// Adds one (not blank) line of a trace. `where` starts each error.
absl::Status AddLine(const std::string& line, const std::string& where, Trace* trace) {
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
  auto& per_rank = trace->plans[rank];
  if (per_rank.count(key)) {
    return absl::InvalidArgumentError(absl::StrCat(where, "rank ", rank, " microbatch ",
                                                   key.ToString(), " appears twice"));
  }
  per_rank[key] = std::move(*calls);
  trace->keys.insert(key);
  trace->max_rank = std::max(trace->max_rank, rank);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Trace> ParseTrace(std::istream& in, const std::string& source) {
  Trace trace;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (absl::Status s = AddLine(line, absl::StrCat(source, ":", lineno, ": "), &trace); !s.ok()) return s;
  }
  if (trace.keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": the trace holds no microbatch"));
  }
  return trace;
}

namespace {

// One entry of a manifest's "modules". `where` starts each error.
absl::StatusOr<ModuleSpec> ParseModule(const json& m, const std::string& where) {
  if (!m.is_object() || !m.contains("name") || !m["name"].is_string()) {
    return absl::InvalidArgumentError(where + " needs a string 'name'");
  }
  ModuleSpec spec;
  spec.name = m["name"].get<std::string>();
  try {
    spec.param_bytes = m.value("param_bytes", int64_t{0});
    spec.outside_inner_root = m.value("outside_inner_root", false);
    if (m.contains("units")) {
      for (const json& u : m["units"]) {
        if (!u.is_object() || !u.contains("name") || !u["name"].is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, " ('", spec.name, "'): each unit must be {\"name\": \"layers.0\", \"param_bytes\": N}"));
        }
        spec.units.push_back({u["name"].get<std::string>(), u.value("param_bytes", int64_t{0})});
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
