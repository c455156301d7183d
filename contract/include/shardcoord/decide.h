// The decision rule for one (group, microbatch, module), DESIGN 3. Pure functions.
#ifndef SHARDCOORD_DECIDE_H_
#define SHARDCOORD_DECIDE_H_

#include <cstdint>
#include <vector>

#include "shardcoord/export.h"
#include "shardcoord/types.h"

namespace shardcoord {

struct RuleOutcome {
  Decision decision = Decision::kUnspecified;
  DecisionReason reason = DecisionReason::kUnspecified;
  int32_t calls = 0;  // kPadded: the passes every rank makes (the busiest rank's calls).
};

// True for the policies that need no plans and never wait for the group.
SHARDCOORD_EXPORT bool IsStaticPolicy(Policy policy);

// `calls[r]` is how many times rank r of the group calls the module in the microbatch.
// - root / replicate: that decision (kStaticPolicy), whatever `calls` holds.
// - per_layer / auto: all zero -> skip; all equal and > 0 -> per_layer; otherwise the
//   fallback (kDivergent): root, replicate, or padded to the busiest rank's calls.
// Promotion and sticky replication are state, kept by the coordinator's engine.
// `policy` and `fallback` must be resolved (not kUnspecified).
SHARDCOORD_EXPORT RuleOutcome ApplyContract(Policy policy, Fallback fallback,
                                            const std::vector<int32_t>& calls);

// FNV-1a 64 over the decision's group, key, seq and module decisions. Stable across
// processes, machines and versions: tests and tools compare it between ranks.
SHARDCOORD_EXPORT uint64_t DecisionDigest(const MicrobatchDecision& d);

}  // namespace shardcoord

#endif  // SHARDCOORD_DECIDE_H_
