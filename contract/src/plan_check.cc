#include "shardcoord/plan_check.h"

#include <algorithm>

namespace shardcoord {

std::string CheckPlanKey(const MicrobatchKey& key) {
  if (key.step < 0 || key.microbatch < 0) return "step and microbatch must be >= 0";
  return "";
}

std::string CheckPlanCall(const std::string& module, int64_t calls, bool known,
                          const std::vector<std::string>& registered) {
  if (!known) {
    constexpr size_t kNamed = 16;  // A manifest may hold a thousand modules.
    std::string list;
    for (size_t i = 0; i < std::min(registered.size(), kNamed); ++i) {
      if (i > 0) list += ", ";
      list += registered[i];
    }
    if (registered.size() > kNamed) list += ", ... (" + std::to_string(registered.size() - kNamed) + " more)";
    return "names unknown module '" + module + "'; the registered controlled modules are [" + list + "]";
  }
  if (calls < 0) {
    return "module '" + module + "' has " + std::to_string(calls) + " calls; calls must be >= 0";
  }
  return "";
}

}  // namespace shardcoord
