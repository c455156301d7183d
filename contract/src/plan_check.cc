#include "shardcoord/plan_check.h"

#include <algorithm>

namespace shardcoord {

std::string NamesForMessage(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < std::min(names.size(), kNamesInMessages); ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  if (names.size() > kNamesInMessages) out += ", ... (" + std::to_string(names.size() - kNamesInMessages) + " more)";
  return out;
}

std::string CheckPlanKey(const MicrobatchKey& key) {
  if (key.step < 0 || key.microbatch < 0) return "step and microbatch must be >= 0";
  return "";
}

std::string CheckPlanCall(const std::string& module, int64_t calls, bool known,
                          const std::vector<std::string>& registered) {
  if (!known) {
    return "names unknown module '" + module + "'; the registered controlled modules are [" +
           NamesForMessage(registered) + "]";
  }
  if (calls < 0) {
    return "module '" + module + "' has " + std::to_string(calls) + " calls; calls must be >= 0";
  }
  return "";
}

}  // namespace shardcoord
