// Text helpers for the coordinator's messages and logs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "shardcoord/plan_check.h"

namespace shardcoord::coordinator {

using shardcoord::kNamesInMessages;

// 64-bit FNV-1a of `text`: a checksum (state file) and a digest of settings, not a secret.
inline uint64_t Fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

inline std::string RankList(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ","); }

// The first few names, then how many more (shared with the worker's messages).
inline std::string NameList(const std::vector<std::string>& names) { return NamesForMessage(names); }

}  // namespace shardcoord::coordinator
