// Shared vocabulary of the uniform-execution contract (DESIGN 3): policies, fallbacks,
// decisions, microbatch keys and the module manifest. Used by the coordinator, the
// worker library and the tools. Plain value types; safe to use from any thread.
#ifndef SHARDCOORD_TYPES_H_
#define SHARDCOORD_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "shardcoord/export.h"

namespace shardcoord {

// Values match shardcoord.v1.Policy.
enum class Policy : int { kUnspecified = 0, kAuto = 1, kPerLayer = 2, kRoot = 3, kReplicate = 4 };
// Values match shardcoord.v1.Fallback.
enum class Fallback : int { kUnspecified = 0, kRoot = 1, kReplicate = 2, kPadded = 3 };
// Values match shardcoord.v1.Decision; the kinds are the rows of decisions.def.
enum class Decision : int {
  kUnspecified = 0,
#define SHARDCOORD_DECISION(e, value, proto, name, colour) e = value,
#include "shardcoord/decisions.def"
#undef SHARDCOORD_DECISION
};
// Values match shardcoord.v1.DecisionReason.
enum class DecisionReason : int {
  kUnspecified = 0,
  kStaticPolicy = 1,
  kUniform = 2,
  kAllSkip = 3,
  kDivergent = 4,
  kStickyReplicate = 5,
  kPromoted = 6,
  kCost = 7,  // Cost-aware `auto` chose a safe placement other than the rule's.
};

// Every value but kUnspecified, in the order names are listed to users: the one list that
// parsing, flags, settings and reports go through.
inline constexpr Policy kPolicies[] = {Policy::kAuto, Policy::kPerLayer, Policy::kRoot, Policy::kReplicate};
inline constexpr Fallback kFallbacks[] = {Fallback::kRoot, Fallback::kReplicate, Fallback::kPadded};
inline constexpr Decision kDecisions[] = {
#define SHARDCOORD_DECISION(e, value, proto, name, colour) Decision::e,
#include "shardcoord/decisions.def"
#undef SHARDCOORD_DECISION
};
inline constexpr size_t kNumDecisions = sizeof(kDecisions) / sizeof(kDecisions[0]);
// The position of `d` in kDecisions (kNumDecisions for kUnspecified or a value no row has):
// an index for arrays of counts by kind.
constexpr size_t DecisionIndex(Decision d) {
  for (size_t i = 0; i < kNumDecisions; ++i) {
    if (kDecisions[i] == d) return i;
  }
  return kNumDecisions;
}

// Lower-case names used in flags, config files, JSON and logs: "auto", "per_layer",
// "root", "replicate", "skip", "padded".
SHARDCOORD_EXPORT const char* PolicyName(Policy p);
SHARDCOORD_EXPORT const char* FallbackName(Fallback f);
SHARDCOORD_EXPORT const char* DecisionName(Decision d);
SHARDCOORD_EXPORT const char* DecisionReasonName(DecisionReason r);
// The chart colour of a kind (decisions.def), for the status page.
SHARDCOORD_EXPORT const char* DecisionColour(Decision d);
// Parse the names above; std::nullopt for anything else (callers report the error).
SHARDCOORD_EXPORT std::optional<Policy> ParsePolicy(std::string_view name);
SHARDCOORD_EXPORT std::optional<Fallback> ParseFallback(std::string_view name);
SHARDCOORD_EXPORT std::optional<Decision> ParseDecision(std::string_view name);
// The names of kPolicies, kFallbacks and kDecisions (a flag's or setting's choices, a list in
// a message).
SHARDCOORD_EXPORT std::vector<std::string> PolicyNames();
SHARDCOORD_EXPORT std::vector<std::string> FallbackNames();
SHARDCOORD_EXPORT std::vector<std::string> DecisionNames();

// Identifies a microbatch. Keys are totally ordered; each rank reports them in strictly
// increasing order.
struct MicrobatchKey {
  int64_t step = 0;
  int32_t microbatch = 0;

  friend bool operator<(const MicrobatchKey& a, const MicrobatchKey& b) {
    return std::tie(a.step, a.microbatch) < std::tie(b.step, b.microbatch);
  }
  friend bool operator==(const MicrobatchKey& a, const MicrobatchKey& b) {
    return a.step == b.step && a.microbatch == b.microbatch;
  }
  friend bool operator!=(const MicrobatchKey& a, const MicrobatchKey& b) { return !(a == b); }
  friend bool operator<=(const MicrobatchKey& a, const MicrobatchKey& b) { return !(b < a); }
  friend bool operator>(const MicrobatchKey& a, const MicrobatchKey& b) { return b < a; }
  // "(step,microbatch)", as in logs and error messages.
  SHARDCOORD_EXPORT std::string ToString() const;
};

// One layer unit of a controlled module.
struct LayerUnit {
  std::string name;
  int64_t param_bytes = 0;
};

// A controlled multimodal module (a fully frozen tower or projector, or one the user opted in
// with trainable parameters). The manifest is the list of these.
struct ModuleSpec {
  std::string name;
  int64_t param_bytes = 0;
  std::vector<LayerUnit> units;
  bool outside_inner_root = false;
  // Some of its parameters train (the whole tower, or adapters on a frozen one): its backward
  // issues collectives too, so only skip, per_layer and root are safe for it (DESIGN 10,
  // "Towers that train"); the engine decides root where replicate or padded would be chosen.
  bool trainable = false;
};

// What a rank will run in one microbatch: module name -> number of calls.
struct MicrobatchPlan {
  MicrobatchKey key;
  std::map<std::string, int32_t> calls;
};

struct ModuleDecision {
  std::string module;
  Decision decision = Decision::kUnspecified;
  DecisionReason reason = DecisionReason::kUnspecified;
  int32_t calls = 0;  // kPadded: the passes every rank makes (the busiest rank's calls); else 0.
};

// Frozen-parameter memory of one controlled module on this rank, for the coordinator.
struct ModuleMemoryUsage {
  std::string module;
  int64_t resident_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t gathered_bytes = 0;
};

// The decision for one (group, microbatch); identical on every rank of the group.
struct MicrobatchDecision {
  int32_t group = 0;
  MicrobatchKey key;
  uint64_t seq = 0;
  int64_t epoch = 0;
  std::vector<ModuleDecision> modules;  // In manifest order.
  uint64_t digest = 0;
  std::string seal;  // The coordinator's MAC (opaque): handed back when the rank resumes.

  // The decision for `module`, or nullptr when the module is not controlled.
  const ModuleDecision* Find(std::string_view module) const {
    for (const auto& m : modules) {
      if (m.module == module) return &m;
    }
    return nullptr;
  }
};

inline std::ostream& operator<<(std::ostream& os, const MicrobatchKey& k) {
  return os << k.ToString();
}

}  // namespace shardcoord

#endif  // SHARDCOORD_TYPES_H_
