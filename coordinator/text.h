// Text helpers for the coordinator's messages and logs.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardcoord::coordinator {

// Names for an error message or a log line: the first few, then how many more. A manifest
// may hold a thousand modules; a message per bad plan must not carry them all.
inline constexpr size_t kNamesInMessages = 16;

inline std::string RankList(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ","); }

inline std::string NameList(const std::vector<std::string>& names) {
  if (names.size() <= kNamesInMessages) return absl::StrJoin(names, ", ");
  return absl::StrCat(absl::StrJoin(names.begin(), names.begin() + kNamesInMessages, ", "), ", ... (",
                      names.size() - kNamesInMessages, " more)");
}

}  // namespace shardcoord::coordinator
