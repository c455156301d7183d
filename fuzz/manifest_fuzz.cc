// libFuzzer target: the manifest parser (JSON; client/trace.h ParseManifest), which also
// checks module and unit names with the contract's rules. Seeds: examples/manifests/.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto modules = shardcoord::client::ParseManifest(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!modules.ok() && modules.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  return 0;
}
