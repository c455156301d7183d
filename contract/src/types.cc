#include "shardcoord/types.h"

#include <string>

namespace shardcoord {

const char* PolicyName(Policy p) {
  switch (p) {
    case Policy::kAuto: return "auto";
    case Policy::kPerLayer: return "per_layer";
    case Policy::kRoot: return "root";
    case Policy::kReplicate: return "replicate";
    case Policy::kUnspecified: break;
  }
  return "unspecified";
}

const char* FallbackName(Fallback f) {
  switch (f) {
    case Fallback::kRoot: return "root";
    case Fallback::kReplicate: return "replicate";
    case Fallback::kPadded: return "padded";
    case Fallback::kUnspecified: break;
  }
  return "unspecified";
}

namespace {

// The rows of decisions.def, in kDecisions order: what each kind is called and drawn in.
struct DecisionRow {
  Decision kind;
  const char* name;
  const char* colour;
};
constexpr DecisionRow kDecisionRows[] = {
#define SHARDCOORD_DECISION(e, value, proto, name, colour) {Decision::e, name, colour},
#include "shardcoord/decisions.def"
#undef SHARDCOORD_DECISION
};

// Its row; null for kUnspecified or a value no row has.
const DecisionRow* RowOf(Decision d) {
  const size_t i = DecisionIndex(d);
  return i < kNumDecisions ? &kDecisionRows[i] : nullptr;
}

}  // namespace

const char* DecisionName(Decision d) {
  const DecisionRow* row = RowOf(d);
  return row != nullptr ? row->name : "unspecified";
}

const char* DecisionColour(Decision d) {
  const DecisionRow* row = RowOf(d);
  return row != nullptr ? row->colour : "#000";
}

const char* DecisionReasonName(DecisionReason r) {
  switch (r) {
    case DecisionReason::kStaticPolicy: return "static_policy";
    case DecisionReason::kUniform: return "uniform";
    case DecisionReason::kAllSkip: return "all_skip";
    case DecisionReason::kDivergent: return "divergent";
    case DecisionReason::kStickyReplicate: return "sticky_replicate";
    case DecisionReason::kPromoted: return "promoted";
    case DecisionReason::kCost: return "cost";
    case DecisionReason::kUnspecified: break;
  }
  return "unspecified";
}

std::optional<Policy> ParsePolicy(std::string_view name) {
  for (Policy p : kPolicies) {
    if (name == PolicyName(p)) return p;
  }
  return std::nullopt;
}

std::optional<Fallback> ParseFallback(std::string_view name) {
  for (Fallback f : kFallbacks) {
    if (name == FallbackName(f)) return f;
  }
  return std::nullopt;
}

std::optional<Decision> ParseDecision(std::string_view name) {
  for (Decision d : kDecisions) {
    if (name == DecisionName(d)) return d;
  }
  return std::nullopt;
}

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names;
  for (Policy p : kPolicies) names.push_back(PolicyName(p));
  return names;
}

std::vector<std::string> FallbackNames() {
  std::vector<std::string> names;
  for (Fallback f : kFallbacks) names.push_back(FallbackName(f));
  return names;
}

std::vector<std::string> DecisionNames() {
  std::vector<std::string> names;
  for (Decision d : kDecisions) names.push_back(DecisionName(d));
  return names;
}

std::string MicrobatchKey::ToString() const {
  return "(" + std::to_string(step) + "," + std::to_string(microbatch) + ")";
}

}  // namespace shardcoord
