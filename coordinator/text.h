// Text helpers for the coordinator's messages and logs.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "shardcoord/plan_check.h"

namespace shardcoord::coordinator {

using shardcoord::kNamesInMessages;

inline std::string RankList(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ","); }

// The first few names, then how many more (shared with the worker's messages).
inline std::string NameList(const std::vector<std::string>& names) { return NamesForMessage(names); }

}  // namespace shardcoord::coordinator
