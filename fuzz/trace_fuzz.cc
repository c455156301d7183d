// libFuzzer target: the replay trace parser (JSON lines; client/trace.h). Seeds:
// examples/traces/. Every input must parse or be refused with INVALID_ARGUMENT naming a line.
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  auto trace = shardcoord::client::ParseTrace(in, "fuzz");
  if (!trace.ok() && trace.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  if (!trace.ok() && trace.status().message().find("fuzz") == std::string::npos) std::abort();  // Names its source.
  return 0;
}
