// What a placement costs (DESIGN 3, "Cost-aware auto"): the one estimate that both the
// coordinator's cost-aware `auto` and `shardctl plan` use, so the planner predicts what the
// daemon decides. Pure functions of measured numbers; no clock, no state.
//
// The model, per controlled module and microbatch of a shard group of n ranks, where rank r
// calls the module c_r times, c = max_r c_r, F = forward seconds per call and G = seconds to
// all-gather every unit of the module once (the slowest member's measures: a collective
// waits for it):
//
//   skip        0                       (only when every c_r = 0)
//   per_layer   c x (G + F)             (only when every c_r = c; each call gathers each unit
//                                        again, since a unit is resharded after its forward)
//   root        G + c x F               (every rank gathers the whole module once, runs its
//                                        calls, and releases it after its last one)
//   replicate   c x F with a resident replica, G + c x F when it has to be built
//   padded      c x (G + F)             (every rank makes c passes, gather-only ones where it
//                                        calls less: the busiest rank's per_layer time)
//
// Peaks (bytes of the module's parameters held at once beyond a rank's shard): per_layer and
// padded the largest unit, root and replicate the whole module. A placement fits when its peak is within
// the budget (0: no budget known, everything fits). Bytes gathered per rank: the whole module
// per gather when n > 1, nothing on a group of one.
#ifndef SHARDCOORD_COST_H_
#define SHARDCOORD_COST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "shardcoord/export.h"
#include "shardcoord/types.h"

namespace shardcoord {

// What one all-gather of one layer unit took on a rank, as its worker measured it.
struct UnitCost {
  std::string unit;
  int64_t gather_bytes = 0;
  double gather_seconds = 0;
};

// What a controlled module costs on a rank, as its worker measured it (medians of recent
// microbatches). Units without a measure are absent.
struct ModuleCost {
  std::string module;
  double forward_seconds_per_call = 0;
  std::vector<UnitCost> units;

  // Seconds to gather every measured unit once.
  double GatherSeconds() const;
};

// A group's cost of one module: the slowest member's forward and gather.
struct ModuleCostModel {
  double forward_seconds_per_call = 0;
  double gather_seconds = 0;

  bool Known() const { return forward_seconds_per_call > 0 || gather_seconds > 0; }
  // Keeps the larger of each measure (the group waits for its slowest member).
  void Take(const ModuleCost& member);
};

// One placement of one module for one microbatch.
struct PlacementEstimate {
  Decision decision = Decision::kUnspecified;
  bool safe = false;           // The contract allows it for these calls (no rank waits alone).
  bool fits = false;           // Its peak is within the budget.
  double seconds = 0;          // The module's share of the microbatch on the group's slowest rank.
  int64_t gathered_bytes = 0;  // Per rank.
  int64_t peak_bytes = 0;      // The module's parameters held at once beyond the shard, per rank.
};

struct CostInputs {
  const ModuleSpec* spec = nullptr;
  ModuleCostModel cost;
  int group_size = 1;
  int64_t budget_bytes = 0;       // Smallest frozen-memory budget of the members; 0: unknown.
  bool replica_resident = false;  // The group holds a replica of the module now.
  bool can_pad = false;           // The group's fallback is padded: its executors pad.
};

SHARDCOORD_EXPORT PlacementEstimate EstimatePlacement(const CostInputs& in, Decision decision,
                                                      const std::vector<int32_t>& calls);

// The cheapest safe placement that fits among skip, per_layer, root and (with `can_pad`)
// padded (a replica is state across microbatches: the engine decides it with ReplicaSaving).
// Ties go to the lower peak, then to the order skip, per_layer, root, padded, so with nothing
// measured the choice is the contract's rule. Padded is never faster than root (c gathers
// against one) but holds one unit: it is chosen for divergent calls when the module does not
// fit the budget, or for one call, where the two take the same time. When no safe placement
// fits, the safe one with the lowest peak (for divergent calls and a module larger than the
// budget without padding, root: the only placement that cannot hang); `over_budget` says so.
struct CostChoice {
  PlacementEstimate chosen;
  PlacementEstimate per_layer;  // The estimates it compared, for the reason's text.
  PlacementEstimate root;
  PlacementEstimate padded;     // Considered only with CostInputs::can_pad.
  bool over_budget = false;
};
SHARDCOORD_EXPORT CostChoice ChooseByCost(const CostInputs& in, const std::vector<int32_t>& calls);

// Seconds a resident replica saves in this microbatch against the cheapest other choice.
SHARDCOORD_EXPORT double ReplicaSaving(const CostInputs& in, const std::vector<int32_t>& calls);

// "root 0.041 s < per_layer 0.062 s for 2 calls (forward 0.010 s/call, gather 0.021 s)":
// the inputs that made a choice, for decisions' events and the planner.
SHARDCOORD_EXPORT std::string DescribeChoice(const CostChoice& choice, const CostInputs& in, int32_t calls);

}  // namespace shardcoord

#endif  // SHARDCOORD_COST_H_
