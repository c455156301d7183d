// libFuzzer target: the cost model file parser of `shardctl plan` (JSON; client/cost_model.h
// ParseCostFile), and matching its modules to a manifest. Seeds: fuzz/seeds/cost/.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cost_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = shardcoord::client::ParseCostFile(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!file.ok()) {
    if (file.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  const std::vector<shardcoord::ModuleSpec> manifest = {{"visual", 1000, {{"blocks.0", 1000}}, false}};
  std::vector<std::string> warnings;
  auto models = shardcoord::client::CostModelsFor(*file, manifest, "fuzz", &warnings);
  if (!models.ok() && models.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  if (models.ok() && models->size() != manifest.size()) std::abort();
  return 0;
}
