// Cost model files of `shardctl plan` (format "shardcoord.cost/v1"), as the GPU benchmark
// writes them: what a job's frozen modules cost, measured once, to estimate placements
// before renting GPUs.
//
//   {"format": "shardcoord.cost/v1",
//    "measured": {...free-form: machine, date, command...},          (optional)
//    "group_size": 2,                                (optional: the group size measured at)
//    "other_seconds_per_microbatch": 0.081,          (everything but the controlled modules)
//    "other_seconds_per_token": 0.0000466,           (optional: the decoder's seconds per token,
//    "other_tokens_per_microbatch": 8192,             forward and backward, and the tokens of the
//                                                     microbatch other_seconds_per_microbatch was
//                                                     measured on; optional, default 0)
//    "modules": [{"name": "visual",
//                 "param_bytes": 1234,               (optional; the manifest's are used)
//                 "forward_seconds_per_call": 0.0123,
//                 "other_seconds_per_call": 0.19,    (optional: the decoder's share of a call)
//                 "units": [{"name": "blocks.0", "gather_seconds": 0.00031,
//                            "param_bytes": 456, "gather_bytes": 456}]}]}   (bytes optional)
//
// Numbers are finite and non-negative; byte counts are integers. Errors (INVALID_ARGUMENT)
// name the file and the field, e.g. "cost.json: modules[0] ('visual').units[1]
// ('blocks.1'): 'gather_seconds' must be a non-negative number, got -1".
#ifndef SHARDCOORD_CLIENT_COST_MODEL_H_
#define SHARDCOORD_CLIENT_COST_MODEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardcoord/cost.h"
#include "shardcoord/types.h"

namespace shardcoord::client {

inline constexpr char kCostFormat[] = "shardcoord.cost/v1";

// One module of a cost file.
struct CostFileModule {
  ModuleCost cost;                     // Name, forward seconds per call, units' gathers.
  std::optional<int64_t> param_bytes;  // As the benchmark saw it, when given.
  // Seconds one call adds to the rest of the model (the decoder's work on the tokens it
  // produced), the same under every placement; optional, 0 when not given.
  double other_seconds_per_call = 0;
};

struct CostFile {
  int group_size = 0;                       // The group size the costs were measured at; 0: not given.
  double other_seconds_per_microbatch = 0;  // Seconds of a microbatch outside the controlled modules.
  // The decoder's seconds per token of a microbatch (forward and backward), when given: with a
  // trace that gives tokens, `shardctl plan` prices a microbatch of N tokens outside the modules
  // at other_seconds_per_microbatch + other_seconds_per_token x (N - other_tokens_per_microbatch)
  // (at least 0), instead of other_seconds_per_microbatch + the modules' other_seconds_per_call.
  std::optional<double> other_seconds_per_token;
  int64_t other_tokens_per_microbatch = 0;
  std::vector<CostFileModule> modules;      // File order; names distinct.
  std::vector<std::string> warnings;        // Fields it ignored (unknown names), one line each.
};

// Parses a cost file's contents. `source` (the file name) starts each error.
absl::StatusOr<CostFile> ParseCostFile(const std::string& json_text, const std::string& source);

// The group cost model of each manifest module (manifest order). A cost file module that the
// manifest lacks is an error (INVALID_ARGUMENT naming it and the manifest's modules); a
// manifest module without costs costs nothing, and a warning says so; param_bytes that differ
// from the manifest's give a warning too (the manifest's are used).
absl::StatusOr<std::vector<ModuleCostModel>> CostModelsFor(const CostFile& file, const std::vector<ModuleSpec>& manifest,
                                                           const std::string& source,
                                                           std::vector<std::string>* warnings);

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_COST_MODEL_H_
