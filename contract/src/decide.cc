#include "shardcoord/decide.h"

#include <algorithm>

namespace shardcoord {

bool IsStaticPolicy(Policy policy) {
  return policy == Policy::kRoot || policy == Policy::kReplicate;
}

RuleOutcome ApplyContract(Policy policy, Fallback fallback, const std::vector<int32_t>& calls) {
  if (policy == Policy::kRoot) return {Decision::kRoot, DecisionReason::kStaticPolicy};
  if (policy == Policy::kReplicate) return {Decision::kReplicate, DecisionReason::kStaticPolicy};
  bool all_zero = std::all_of(calls.begin(), calls.end(), [](int32_t c) { return c == 0; });
  if (all_zero) return {Decision::kSkip, DecisionReason::kAllSkip};
  bool all_equal = std::all_of(calls.begin(), calls.end(),
                               [&](int32_t c) { return c == calls.front(); });
  if (all_equal) return {Decision::kPerLayer, DecisionReason::kUniform};
  if (fallback == Fallback::kPadded) {
    return {Decision::kPadded, DecisionReason::kDivergent, *std::max_element(calls.begin(), calls.end())};
  }
  return {fallback == Fallback::kReplicate ? Decision::kReplicate : Decision::kRoot,
          DecisionReason::kDivergent};
}

namespace {

constexpr uint64_t kFnvOffset = 1469598103934665603ULL;
constexpr uint64_t kFnvPrime = 1099511628211ULL;

void Mix(uint64_t* h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    *h ^= p[i];
    *h *= kFnvPrime;
  }
}

// Integers are mixed little-endian, whatever the host, so digests match across machines.
void MixInt(uint64_t* h, uint64_t v) {
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(v >> (8 * i));
  Mix(h, bytes, sizeof(bytes));
}

}  // namespace

uint64_t DecisionDigest(const MicrobatchDecision& d) {
  uint64_t h = kFnvOffset;
  MixInt(&h, static_cast<uint64_t>(d.group));
  MixInt(&h, static_cast<uint64_t>(d.key.step));
  MixInt(&h, static_cast<uint64_t>(d.key.microbatch));
  MixInt(&h, d.seq);
  for (const auto& m : d.modules) {
    MixInt(&h, m.module.size());
    Mix(&h, m.module.data(), m.module.size());
    MixInt(&h, static_cast<uint64_t>(m.decision));
    MixInt(&h, static_cast<uint64_t>(m.reason));
    // Only a padded decision mixes its passes: every other digest stays what it was.
    if (m.decision == Decision::kPadded) MixInt(&h, static_cast<uint64_t>(m.calls));
  }
  return h;
}

}  // namespace shardcoord
