#include "cost_model.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "json_values.h"

namespace shardcoord::client {

using nlohmann::json;

namespace {

absl::Status Missing(const std::string& where, const char* field, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": '", field, "' is missing (", what, ")"));
}

// j[field] as a finite non-negative number of seconds. Absent: an error when `required`,
// else *out keeps its value.
absl::Status ReadSeconds(const json& j, const char* field, const std::string& where, bool required, double* out) {
  if (!j.contains(field)) return required ? Missing(where, field, "seconds, a non-negative number") : absl::OkStatus();
  const json& v = j.at(field);
  // At most a day: 1e308 s made every estimate infinite (or NaN once multiplied by 0).
  constexpr double kMaxSeconds = 86400;
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0 || v.get<double>() > kMaxSeconds) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": '", field,
                                                   "' must be a number of seconds from 0 to 86400, got ", JsonShown(v)));
  }
  *out = v.get<double>();
  return absl::OkStatus();
}

// j[field] as an integer in [min, max]. Absent: *out keeps its value.
absl::Status ReadInteger(const json& j, const char* field, const std::string& where, int64_t min, int64_t max,
                         int64_t* out) {
  if (!j.contains(field)) return absl::OkStatus();
  const json& v = j.at(field);
  if (!JsonIntegerIn(v, min, max)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": '", field, "' must be an integer in ", min, "..", max, ", got ", JsonShown(v)));
  }
  *out = v.get<int64_t>();
  return absl::OkStatus();
}

// j's "name": a string, non-empty unless `may_be_empty` (a unit's: "" is the rest unit).
absl::StatusOr<std::string> ReadName(const json& j, const std::string& where, bool may_be_empty = false) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": must be an object, got ", JsonShown(j)));
  if (!j.contains("name")) return Missing(where, "name", "a string");
  if (!j.at("name").is_string() || (!may_be_empty && j.at("name").get<std::string>().empty())) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": 'name' must be a ", may_be_empty ? "" : "non-empty ",
                                                   "string, got ", JsonShown(j.at("name"))));
  }
  return j.at("name").get<std::string>();
}

// One warning per field of `j` not in `known`: a typo there would silently cost nothing.
void WarnUnknown(const json& j, std::initializer_list<const char*> known, const std::string& where,
                 std::vector<std::string>* warnings) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool found = false;
    for (const char* k : known) found = found || it.key() == k;
    if (!found) {
      warnings->push_back(absl::StrCat(where, ": unknown field '", it.key(), "' ignored (fields: ",
                                       absl::StrJoin(known, ", "), ")"));
    }
  }
}

// One entry of a module's "units".
absl::StatusOr<UnitCost> ParseUnit(const json& u, const std::string& at, std::vector<std::string>* warnings) {
  absl::StatusOr<std::string> name = ReadName(u, at, /*may_be_empty=*/true);  // "": the rest unit.
  if (!name.ok()) return name.status();
  const std::string where = absl::StrCat(at, " ('", *name, "')");
  UnitCost unit;
  unit.unit = *name;
  int64_t param_bytes = 0;
  absl::Status s = ReadSeconds(u, "gather_seconds", where, /*required=*/true, &unit.gather_seconds);
  if (s.ok()) s = ReadInteger(u, "param_bytes", where, 0, INT64_MAX, &param_bytes);
  unit.gather_bytes = param_bytes;
  if (s.ok()) s = ReadInteger(u, "gather_bytes", where, 0, INT64_MAX, &unit.gather_bytes);
  if (!s.ok()) return s;
  WarnUnknown(u, {"name", "gather_seconds", "param_bytes", "gather_bytes"}, where, warnings);
  return unit;
}

// A module's "units" into `cost`; unit names distinct.
absl::Status ParseUnits(const json& m, const std::string& where, ModuleCost* cost, std::vector<std::string>* warnings) {
  if (!m.contains("units")) return Missing(where, "units", "a list, [] when nothing is gathered");
  if (!m.at("units").is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": 'units' must be a list, got ", JsonShown(m.at("units"))));
  }
  std::set<std::string> seen;
  for (size_t k = 0; k < m.at("units").size(); ++k) {
    absl::StatusOr<UnitCost> unit = ParseUnit(m.at("units")[k], absl::StrCat(where, ".units[", k, "]"), warnings);
    if (!unit.ok()) return unit.status();
    if (!seen.insert(unit->unit).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".units[", k, "]: unit '", unit->unit, "' appears twice"));
    }
    cost->units.push_back(std::move(*unit));
  }
  return absl::OkStatus();
}

// One entry of "modules".
absl::StatusOr<CostFileModule> ParseModule(const json& m, const std::string& at, std::vector<std::string>* warnings) {
  absl::StatusOr<std::string> name = ReadName(m, at);
  if (!name.ok()) return name.status();
  const std::string where = absl::StrCat(at, " ('", *name, "')");
  CostFileModule module;
  module.cost.module = *name;
  int64_t param_bytes = -1;
  absl::Status s = ReadSeconds(m, "forward_seconds_per_call", where, /*required=*/true,
                               &module.cost.forward_seconds_per_call);
  if (s.ok()) s = ReadInteger(m, "param_bytes", where, 0, INT64_MAX, &param_bytes);
  if (s.ok()) s = ReadSeconds(m, "other_seconds_per_call", where, /*required=*/false, &module.other_seconds_per_call);
  if (s.ok()) s = ParseUnits(m, where, &module.cost, warnings);
  if (!s.ok()) return s;
  if (param_bytes >= 0) module.param_bytes = param_bytes;
  WarnUnknown(m, {"name", "param_bytes", "forward_seconds_per_call", "other_seconds_per_call", "units"}, where,
              warnings);
  return module;
}

// "other_seconds_per_token" and "other_tokens_per_microbatch" (the tokens without the price: a
// warning, it is ignored).
absl::Status ParseTokenPrice(const json& j, const std::string& source, CostFile* file) {
  double per_token = 0;
  absl::Status s = ReadSeconds(j, "other_seconds_per_token", source, /*required=*/false, &per_token);
  if (s.ok()) s = ReadInteger(j, "other_tokens_per_microbatch", source, 0, INT32_MAX, &file->other_tokens_per_microbatch);
  if (!s.ok()) return s;
  if (j.contains("other_seconds_per_token")) {
    file->other_seconds_per_token = per_token;
  } else if (j.contains("other_tokens_per_microbatch")) {
    file->warnings.push_back(absl::StrCat(source, ": 'other_tokens_per_microbatch' without 'other_seconds_per_token' ",
                                          "is ignored (give both to price a trace's tokens)"));
  }
  return absl::OkStatus();
}

// "format", "measured", "group_size", "other_seconds_per_microbatch" and the token price.
absl::Status ParseHeader(const json& j, const std::string& source, CostFile* file) {
  if (!j.contains("format")) return Missing(source, "format", absl::StrCat("\"", kCostFormat, "\"").c_str());
  if (j.at("format") != kCostFormat) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": 'format' is ", JsonShown(j.at("format")), ", expected \"",
                                                   kCostFormat, "\" (a cost model the GPU benchmark writes)"));
  }
  if (j.contains("measured") && !j.at("measured").is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": 'measured' must be an object (free-form), got ", JsonShown(j.at("measured"))));
  }
  int64_t group_size = 0;
  absl::Status s = ReadInteger(j, "group_size", source, 1, INT32_MAX, &group_size);
  file->group_size = static_cast<int>(group_size);
  if (s.ok()) {
    s = ReadSeconds(j, "other_seconds_per_microbatch", source, /*required=*/true, &file->other_seconds_per_microbatch);
  }
  if (s.ok()) s = ParseTokenPrice(j, source, file);
  return s;
}

}  // namespace

absl::StatusOr<CostFile> ParseCostFile(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": must be a JSON object"));
  CostFile file;
  if (absl::Status s = ParseHeader(j, source, &file); !s.ok()) return s;
  if (!j.contains("modules")) return Missing(source, "modules", "a list of {\"name\": ..., ...}");
  if (!j.at("modules").is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": 'modules' must be a list, got ", JsonShown(j.at("modules"))));
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < j.at("modules").size(); ++i) {
    const std::string at = absl::StrCat(source, ": modules[", i, "]");
    absl::StatusOr<CostFileModule> m = ParseModule(j.at("modules")[i], at, &file.warnings);
    if (!m.ok()) return m.status();
    if (!seen.insert(m->cost.module).second) {
      return absl::InvalidArgumentError(absl::StrCat(at, ": module '", m->cost.module, "' appears twice"));
    }
    file.modules.push_back(std::move(*m));
  }
  WarnUnknown(j,
              {"format", "measured", "group_size", "other_seconds_per_microbatch", "other_seconds_per_token",
               "other_tokens_per_microbatch", "modules"},
              source, &file.warnings);
  return file;
}

absl::StatusOr<std::vector<ModuleCostModel>> CostModelsFor(const CostFile& file, const std::vector<ModuleSpec>& manifest,
                                                           const std::string& source,
                                                           std::vector<std::string>* warnings) {
  std::map<std::string, size_t> index;
  std::vector<std::string> names;
  for (size_t m = 0; m < manifest.size(); ++m) {
    index[manifest[m].name] = m;
    names.push_back(manifest[m].name);
  }
  std::vector<ModuleCostModel> models(manifest.size());
  std::vector<bool> costed(manifest.size(), false);
  for (const CostFileModule& m : file.modules) {
    auto it = index.find(m.cost.module);
    if (it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": module '", m.cost.module, "' is not in the manifest [",
                                                     absl::StrJoin(names, ", "), "]"));
    }
    models[it->second].Take(m.cost);
    costed[it->second] = true;
    const int64_t manifest_bytes = manifest[it->second].param_bytes;
    if (m.param_bytes && *m.param_bytes != manifest_bytes) {
      warnings->push_back(absl::StrCat(source, ": module '", m.cost.module, "' has param_bytes ", *m.param_bytes,
                                       ", the manifest ", manifest_bytes, "; the manifest's are used"));
    }
  }
  for (size_t m = 0; m < manifest.size(); ++m) {
    if (!costed[m]) {
      warnings->push_back(absl::StrCat(source, ": no costs for module '", manifest[m].name,
                                       "' of the manifest; it is taken to cost nothing"));
    }
  }
  return models;
}

}  // namespace shardcoord::client
