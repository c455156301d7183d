// Rebuilding a shard group after a coordinator restart (DESIGN 12), as a pure function of
// what its members report when they resume: no state, no clock, unit-tested on its own.
//
// The rule: a decision any member holds is binding and goes unchanged to every member that
// planned the key without receiving it; two different decisions held for one key fail the
// group (it must never happen, and is detected); a key nobody holds is decided afresh, once
// every member has reported (the caller's ordinary rule). `auto`'s sticky state is rebuilt
// from the newest binding decision.
#ifndef SHARDCOORD_COORDINATOR_ENGINE_RECOVERY_H_
#define SHARDCOORD_COORDINATOR_ENGINE_RECOVERY_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/types.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

// One member's report, as it resumed.
struct MemberResume {
  int rank = 0;
  v1::ResumeState state;
};

struct GroupRecovery {
  absl::Status status;  // FAILED_PRECONDITION naming the key and ranks (contradiction), or the epochs.
  int64_t epoch = 0;
  std::map<MicrobatchKey, v1::MicrobatchDecision> binding;  // Every decision some member holds.
  std::map<MicrobatchKey, std::set<int>> holders;           // Ranks holding each binding key.
  // (rank, decision): a member that planned the key and lacks its decision.
  std::vector<std::pair<int, v1::MicrobatchDecision>> resend;
  // (rank, plan): plans no member holds a decision for, to decide as usual, in key order.
  std::vector<std::pair<int, MicrobatchPlan>> undecided;
  // (rank, key): plans older than the newest binding key that nobody holds a decision
  // for: their decision is lost (beyond what members keep); they fail.
  std::vector<std::pair<int, MicrobatchKey>> lost;
  uint64_t next_seq = 0;  // 1 + the highest seq of any binding decision.
  // Modules the newest binding decision replicates by promotion or sticky fallback.
  std::set<std::string> promoted;
  std::set<std::string> sticky;
};

GroupRecovery PlanGroupRecovery(int group, const std::vector<MemberResume>& members);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_ENGINE_RECOVERY_H_
