// Text helpers for the coordinator's messages and logs.
#ifndef SHARDCOORD_COORDINATOR_ENGINE_TEXT_H_
#define SHARDCOORD_COORDINATOR_ENGINE_TEXT_H_

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

// At most kRanksInMessages ranks are named, then how many more: a message about a group of
// 16,384 ranks stays short (a list of every rank in every rank's event was quadratic).
inline constexpr size_t kRanksInMessages = 32;
inline std::string RankList(const std::vector<int>& ranks) {
  if (ranks.size() <= kRanksInMessages) return absl::StrJoin(ranks, ",");
  return absl::StrCat(absl::StrJoin(ranks.begin(), ranks.begin() + kRanksInMessages, ","), ",... (",
                      ranks.size() - kRanksInMessages, " more)");
}

// The first few names, then how many more (shared with the worker's messages).
inline std::string NameList(const std::vector<std::string>& names) { return NamesForMessage(names); }

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_ENGINE_TEXT_H_
