// `shardctl plan`, the what-if planner: from a trace, a manifest and a cost model, what each
// placement policy would decide, gather, hold and take per step, before renting GPUs.
//
// Every estimate is the shared one of shardcoord/cost.h (EstimatePlacement), the one the
// daemon's cost-aware `auto` weighs. The policies:
//
//   root, replicate  static: every group microbatch decided so (a static replica is built
//                    before training: it never gathers)
//   per_layer        static per-layer sharding without a coordinator: a microbatch whose
//                    ranks call a module different numbers of times WOULD HANG (counted;
//                    the policy is unsafe)
//   dummy            per_layer, with every rank of a group running the module as often as
//                    its busiest rank (a dummy forward for ranks with fewer calls): safe
//   sc_per_layer     shardcoord policy per_layer, fallback --fallback (root by default; the daemon's engine)
//   auto             shardcoord policy auto, the same fallback, promotion with --budget-bytes
//                    (the daemon's engine, replayed microbatch by microbatch per group)
//
// Static per_layer and dummy count a microbatch in which no rank calls the module as `skip`
// (nothing runs, nothing is gathered).
//
// The rest of a group microbatch (the decoder, the optimizer's share), the same under every
// policy, is priced in one place (OtherSeconds in plan.cc), on the group's busiest rank: per
// token when the trace gives tokens and the cost file other_seconds_per_token (the most tokens
// any member's microbatch has; a member without a line has none), else per microbatch plus each
// module's other_seconds_per_call for the most calls any member makes. No shared state: callable
// from any thread; no clock, no I/O but the streams given.
#ifndef SHARDCOORD_CLIENT_PLAN_H_
#define SHARDCOORD_CLIENT_PLAN_H_

#include <array>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "cost_model.h"
#include "shardcoord/cost.h"
#include "shardcoord/types.h"
#include "trace.h"

namespace shardcoord::client {

enum class PlanPolicy { kRoot, kReplicate, kPerLayer, kDummy, kScPerLayer, kAuto };
inline constexpr std::array<PlanPolicy, 6> kAllPlanPolicies = {
    PlanPolicy::kRoot,  PlanPolicy::kReplicate,  PlanPolicy::kPerLayer,
    PlanPolicy::kDummy, PlanPolicy::kScPerLayer, PlanPolicy::kAuto,
};

// "root", "replicate", "per_layer", "dummy", "sc_per_layer", "auto".
const char* PlanPolicyName(PlanPolicy p);
std::optional<PlanPolicy> ParsePlanPolicy(std::string_view name);

// Most group microbatches (groups holding a rank of the trace x microbatches) one plan
// simulates per policy: a sparse trace naming many ranks and many microbatches, a line
// each, would otherwise take hours. Groups none of whose ranks the trace names are all
// alike and simulated once.
inline constexpr int64_t kMaxPlanGroupMicrobatches = int64_t{1} << 27;

struct PlanOptions {
  int world_size = 0;  // 0: the trace's highest rank + 1.
  int group_size = 0;  // 0: the cost file's group_size, else the world size.
  std::vector<PlanPolicy> policies{kAllPlanPolicies.begin(), kAllPlanPolicies.end()};
  int64_t budget_bytes = 0;  // Frozen memory per rank beyond its shards; 0: no budget.
  Fallback fallback = Fallback::kRoot;  // sc_per_layer's and auto's, as a group would register it.
  bool json = false;         // One JSON object per policy per line instead of the table.
  std::string trace_name = "trace";
  std::string cost_name = "cost";
};

// What one policy does over the whole trace.
struct PolicyEstimate {
  PlanPolicy policy = PlanPolicy::kRoot;
  // Group decisions by kind, indexed by Decision (each group, microbatch and module once).
  std::array<int64_t, 6> decisions{};
  int64_t group_microbatches = 0;
  int64_t hang_microbatches = 0;  // Group microbatches in which some module would hang.
  int64_t steps = 0;
  // Per step: the busiest group's figure (a step ends when its slowest group does); the
  // mean over steps. Per rank.
  double seconds_per_step = 0;
  double gathered_bytes_per_step = 0;
  // Largest over group microbatches of the modules' peaks summed (replicas held included):
  // frozen bytes a rank holds at once beyond its shards.
  int64_t peak_bytes = 0;
  bool fits = true;  // peak_bytes within the budget (always, without one).
  bool safe() const { return hang_microbatches == 0; }
};

// What the planner needs, resolved and checked.
struct PlanSetup {
  const Trace* trace = nullptr;
  std::vector<ModuleSpec> modules;      // The manifest, in its order.
  std::vector<ModuleCostModel> costs;   // Parallel to modules.
  std::vector<double> other_seconds_per_call;  // Parallel to modules: see CostFileModule.
  // Parallel to modules: the most calls any rank makes in any microbatch of the trace (at
  // least 1): what `dummy` pads every rank to in every microbatch.
  std::vector<int32_t> most_calls;
  double other_seconds_per_microbatch = 0;
  // The trace gives tokens and the cost file prices them: see CostFile::other_seconds_per_token.
  bool per_token = false;
  double other_seconds_per_token = 0;
  int64_t other_tokens_per_microbatch = 0;
  int world_size = 0;
  int group_size = 0;
  int64_t budget_bytes = 0;
  Fallback fallback = Fallback::kRoot;
};

// Estimates one policy over every group and microbatch of the trace.
PolicyEstimate EstimatePolicy(const PlanSetup& setup, PlanPolicy policy);

// The index in `estimates` of the fastest policy that cannot hang and fits the budget (ties:
// the lower peak, then the earlier); nullopt when none does.
std::optional<size_t> BestSafePolicy(const std::vector<PolicyEstimate>& estimates);

// Exit codes of `shardctl plan`, as replay's.
inline constexpr int kPlanOk = 0;
inline constexpr int kPlanBadInput = 2;

// Checks the inputs against each other, estimates every policy of `options` and prints them
// (a table, or JSON lines) to `out`; warnings and errors go to `err`, a line each. Returns
// kPlanOk, or kPlanBadInput when the inputs do not fit (a module of the trace or of the cost
// file not in the manifest, a group size that does not divide the world, a rank outside it).
int RunPlan(const Trace& trace, const std::vector<ModuleSpec>& manifest, const CostFile& costs,
            const PlanOptions& options, std::ostream& out, std::ostream& err);

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_PLAN_H_
