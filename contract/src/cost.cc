#include "shardcoord/cost.h"

#include <algorithm>
#include <cstdio>

namespace shardcoord {

double ModuleCost::GatherSeconds() const {
  double total = 0;
  for (const UnitCost& u : units) total += std::max(0.0, u.gather_seconds);
  return total;
}

void ModuleCostModel::Take(const ModuleCost& member) {
  forward_seconds_per_call = std::max(forward_seconds_per_call, member.forward_seconds_per_call);
  gather_seconds = std::max(gather_seconds, member.GatherSeconds());
}

namespace {

struct CallShape {
  int32_t max = 0;
  bool all_zero = true;
  bool all_equal = true;
};

CallShape ShapeOf(const std::vector<int32_t>& calls) {
  CallShape s;
  for (int32_t c : calls) {
    s.max = std::max(s.max, c);
    if (c != 0) s.all_zero = false;
    if (c != calls.front()) s.all_equal = false;
  }
  return s;
}

// What one per_layer call holds at its peak (DESIGN 5): the rest unit ("") beside the largest
// layer unit; a module without units is gathered whole.
int64_t PerLayerPeak(const ModuleSpec& spec) {
  int64_t rest = 0, largest = 0;
  for (const LayerUnit& u : spec.units) {
    if (u.name.empty()) {
      rest = u.param_bytes;
    } else {
      largest = std::max(largest, u.param_bytes);
    }
  }
  return rest + largest > 0 ? rest + largest : spec.param_bytes;
}

}  // namespace

PlacementEstimate EstimatePlacement(const CostInputs& in, Decision decision, const std::vector<int32_t>& calls) {
  const CallShape shape = ShapeOf(calls);
  const double f = in.cost.forward_seconds_per_call;
  const double g = in.cost.gather_seconds;
  const int64_t module_bytes = in.spec->param_bytes;
  const int64_t gather_bytes = in.group_size > 1 ? module_bytes : 0;
  PlacementEstimate e;
  e.decision = decision;
  switch (decision) {
    case Decision::kSkip:
      e.safe = shape.all_zero;
      break;
    case Decision::kPerLayer:
      e.safe = shape.all_equal;
      e.seconds = shape.max * (g + f);
      e.gathered_bytes = shape.max * gather_bytes;
      e.peak_bytes = shape.max > 0 ? PerLayerPeak(*in.spec) : 0;
      break;
    case Decision::kRoot:
      e.safe = true;
      e.seconds = g + shape.max * f;
      e.gathered_bytes = gather_bytes;
      e.peak_bytes = module_bytes;
      break;
    case Decision::kPadded:
      e.safe = true;
      e.seconds = shape.max * (g + f);
      e.gathered_bytes = shape.max * gather_bytes;
      e.peak_bytes = shape.max > 0 ? PerLayerPeak(*in.spec) : 0;
      break;
    case Decision::kReplicate:
      e.safe = true;
      e.seconds = (in.replica_resident ? 0 : g) + shape.max * f;
      e.gathered_bytes = in.replica_resident ? 0 : gather_bytes;
      e.peak_bytes = module_bytes;
      break;
    case Decision::kUnspecified:
      break;
  }
  e.fits = in.budget_bytes <= 0 || e.peak_bytes <= in.budget_bytes;
  return e;
}

namespace {

// a is a better choice than b: faster, then a lower peak (the order of the candidates breaks
// remaining ties).
bool Better(const PlacementEstimate& a, const PlacementEstimate& b) {
  if (a.seconds != b.seconds) return a.seconds < b.seconds;
  return a.peak_bytes < b.peak_bytes;
}

}  // namespace

CostChoice ChooseByCost(const CostInputs& in, const std::vector<int32_t>& calls) {
  CostChoice choice;
  const PlacementEstimate skip = EstimatePlacement(in, Decision::kSkip, calls);
  choice.per_layer = EstimatePlacement(in, Decision::kPerLayer, calls);
  choice.root = EstimatePlacement(in, Decision::kRoot, calls);
  choice.padded = EstimatePlacement(in, Decision::kPadded, calls);
  choice.padded.safe = in.can_pad;  // Safe for any calls, but only executors that pad carry it out.
  bool found = false;
  const PlacementEstimate* candidates[] = {&skip, &choice.per_layer, &choice.root, &choice.padded};
  for (const PlacementEstimate* e : candidates) {
    if (!e->safe || !e->fits) continue;
    if (!found || Better(*e, choice.chosen)) choice.chosen = *e;
    found = true;
  }
  if (!found) {  // Nothing safe fits: the safe placement that holds the least (root is always safe).
    choice.chosen = choice.root;
    for (const PlacementEstimate* e : candidates) {
      if (e->safe && e->peak_bytes < choice.chosen.peak_bytes) choice.chosen = *e;
    }
    choice.over_budget = true;
  }
  return choice;
}

double ReplicaSaving(const CostInputs& in, const std::vector<int32_t>& calls) {
  CostInputs resident = in;
  resident.replica_resident = true;
  resident.budget_bytes = 0;  // Compared on time alone: the engine checks the replica's fit.
  const CostChoice best = ChooseByCost(resident, calls);
  const PlacementEstimate replica = EstimatePlacement(resident, Decision::kReplicate, calls);
  return std::max(0.0, best.chosen.seconds - replica.seconds);
}

std::string DescribeChoice(const CostChoice& choice, const CostInputs& in, int32_t calls) {
  // Root is compared with what it replaced (per_layer for uniform calls, else padded); every
  // other choice with root.
  const PlacementEstimate& other = choice.chosen.decision != Decision::kRoot ? choice.root
                                   : choice.per_layer.safe || !choice.padded.safe ? choice.per_layer
                                                                                  : choice.padded;
  char text[320];
  std::snprintf(text, sizeof(text),
                "%s %.4f s %s %s %.4f s for %d call(s) (forward %.4f s/call, gather %.4f s, "
                "peak %lld vs %lld bytes, budget %lld)%s",
                DecisionName(choice.chosen.decision), choice.chosen.seconds,
                choice.chosen.seconds <= other.seconds ? "<=" : ">", DecisionName(other.decision),
                other.seconds, calls, in.cost.forward_seconds_per_call, in.cost.gather_seconds,
                static_cast<long long>(choice.chosen.peak_bytes), static_cast<long long>(other.peak_bytes),
                static_cast<long long>(in.budget_bytes),
                choice.over_budget ? "; nothing safe fits the budget: the safe placement that holds the least "
                                     "(for divergent calls root, the one placement that cannot hang; fallback "
                                     "padded would hold one unit)"
                                   : "");
  return text;
}

}  // namespace shardcoord
