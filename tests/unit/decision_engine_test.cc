// Unit tests of the coordinator's DecisionEngine: sequence numbers and digests, the pure
// rule per module, sticky replication after a divergence with fallback replicate, and
// `auto` promotion / demotion (coordinator/options.h PromotionOptions).
#include "coordinator/engine/decision_engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "shardcoord/cost.h"
#include "shardcoord/decide.h"
#include "shardcoord/types.h"

namespace {

using namespace shardcoord;
using shardcoord::coordinator::DecisionEngine;
using shardcoord::coordinator::EngineConfig;
using shardcoord::coordinator::EngineTransition;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

using Calls = std::vector<std::vector<int32_t>>;  // [module][member]

constexpr int64_t kTowerBytes = 1000;

// Manifest: vision_tower (1000 bytes), audio_tower (500 bytes), in this order.
EngineConfig MakeConfig(Policy policy, Fallback fallback) {
  EngineConfig c;
  c.group = 2;
  c.policy = policy;
  c.fallback = fallback;
  c.modules = {ModuleSpec{"vision_tower", kTowerBytes, {{"layers.0", 500}, {"layers.1", 500}}},
               ModuleSpec{"audio_tower", 500, {}}};
  return c;
}

// One module, with the promotion settings of the brief: window 4, promote at 2 divergent,
// demote at 0, and a budget that the module fits.
EngineConfig PromotionConfig(Policy policy = Policy::kAuto, Fallback fallback = Fallback::kRoot) {
  EngineConfig c;
  c.group = 0;
  c.policy = policy;
  c.fallback = fallback;
  c.modules = {ModuleSpec{"vision_tower", kTowerBytes, {}}};
  c.promotion.window = 4;
  c.promotion.promote_threshold = 2;
  c.promotion.demote_threshold = 0;
  c.min_memory_budget_bytes = kTowerBytes;  // Exactly fits: promotion allowed.
  return c;
}

const Calls kDivergent1 = {{1, 0}};
const Calls kUniform1 = {{1, 1}};
const Calls kSkip1 = {{0, 0}};

void ExpectModule(const MicrobatchDecision& d, size_t index, const std::string& name,
                  Decision decision, DecisionReason reason) {
  ASSERT_LT(index, d.modules.size());
  EXPECT_EQ(d.modules[index].module, name);
  EXPECT_EQ(d.modules[index].decision, decision)
      << "seq " << d.seq << ": got " << DecisionName(d.modules[index].decision) << ", want "
      << DecisionName(decision);
  EXPECT_EQ(d.modules[index].reason, reason)
      << "seq " << d.seq << ": got " << DecisionReasonName(d.modules[index].reason) << ", want "
      << DecisionReasonName(reason);
}

std::vector<std::string> Whats(const std::vector<EngineTransition>& t) {
  std::vector<std::string> out;
  for (const auto& x : t) out.push_back(x.what);
  return out;
}

TEST(DecisionEngineTest, AssignsSeqInOrderAndDigestMatches) {
  DecisionEngine engine(MakeConfig(Policy::kAuto, Fallback::kRoot));
  EXPECT_EQ(engine.next_seq(), 0u);
  for (uint64_t i = 0; i < 3; ++i) {
    const MicrobatchKey key{static_cast<int64_t>(i / 2), static_cast<int32_t>(i % 2)};
    MicrobatchDecision d = engine.Decide(key, /*epoch=*/7, {{1, 1}, {0, 0}});
    EXPECT_EQ(d.seq, i);
    EXPECT_EQ(d.key, key);
    EXPECT_EQ(d.group, 2);
    EXPECT_EQ(d.epoch, 7);
    EXPECT_EQ(d.digest, DecisionDigest(d));
    EXPECT_EQ(engine.next_seq(), i + 1);
  }
}

TEST(DecisionEngineTest, DecisionsAreInManifestOrder) {
  EngineConfig c = MakeConfig(Policy::kAuto, Fallback::kRoot);
  // Deliberately not alphabetical.
  c.modules = {ModuleSpec{"z_visual", 10, {}}, ModuleSpec{"a_audio_tower", 10, {}},
               ModuleSpec{"m_mm_projector", 10, {}}};
  DecisionEngine engine(c);
  MicrobatchDecision d = engine.Decide({0, 0}, 0, {{1, 1}, {0, 0}, {1, 0}});
  ASSERT_EQ(d.modules.size(), 3u);
  ExpectModule(d, 0, "z_visual", Decision::kPerLayer, DecisionReason::kUniform);
  ExpectModule(d, 1, "a_audio_tower", Decision::kSkip, DecisionReason::kAllSkip);
  ExpectModule(d, 2, "m_mm_projector", Decision::kRoot, DecisionReason::kDivergent);
}

TEST(DecisionEngineTest, PerLayerSkipAndFallbackRootPerModule) {
  DecisionEngine engine(MakeConfig(Policy::kPerLayer, Fallback::kRoot));
  std::vector<EngineTransition> transitions;
  MicrobatchDecision d0 = engine.Decide({0, 0}, 0, {{2, 2}, {0, 0}}, &transitions);
  ExpectModule(d0, 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
  ExpectModule(d0, 1, "audio_tower", Decision::kSkip, DecisionReason::kAllSkip);

  MicrobatchDecision d1 = engine.Decide({0, 1}, 0, {{1, 0}, {1, 2}}, &transitions);
  ExpectModule(d1, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
  ExpectModule(d1, 1, "audio_tower", Decision::kRoot, DecisionReason::kDivergent);

  // Fallback root holds no state: the next uniform microbatch is per_layer again.
  MicrobatchDecision d2 = engine.Decide({1, 0}, 0, {{1, 1}, {3, 3}}, &transitions);
  ExpectModule(d2, 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
  ExpectModule(d2, 1, "audio_tower", Decision::kPerLayer, DecisionReason::kUniform);

  EXPECT_THAT(transitions, IsEmpty());
  EXPECT_THAT(engine.ReplicatedModules(), IsEmpty());
}

TEST(DecisionEngineTest, FallbackPaddedPadsDivergentCallsToTheBusiestRankAndHoldsNoState) {
  DecisionEngine engine(MakeConfig(Policy::kPerLayer, Fallback::kPadded));
  std::vector<EngineTransition> transitions;
  MicrobatchDecision d0 = engine.Decide({0, 0}, 0, {{3, 1}, {0, 2}}, &transitions);
  ExpectModule(d0, 0, "vision_tower", Decision::kPadded, DecisionReason::kDivergent);
  ExpectModule(d0, 1, "audio_tower", Decision::kPadded, DecisionReason::kDivergent);
  EXPECT_EQ(d0.modules[0].calls, 3);
  EXPECT_EQ(d0.modules[1].calls, 2);
  EXPECT_EQ(d0.digest, DecisionDigest(d0));
  MicrobatchDecision d1 = engine.Decide({0, 1}, 0, {{1, 1}, {0, 0}}, &transitions);
  ExpectModule(d1, 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
  EXPECT_EQ(d1.modules[0].calls, 0);
  ExpectModule(d1, 1, "audio_tower", Decision::kSkip, DecisionReason::kAllSkip);
  EXPECT_THAT(transitions, IsEmpty());
  EXPECT_THAT(engine.ReplicatedModules(), IsEmpty());
}

TEST(DecisionEngineTest, FallbackReplicateIsSticky) {
  DecisionEngine engine(MakeConfig(Policy::kPerLayer, Fallback::kReplicate));
  std::vector<EngineTransition> transitions;

  MicrobatchDecision d0 = engine.Decide({0, 0}, 0, {{1, 1}, {0, 0}}, &transitions);
  ExpectModule(d0, 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
  EXPECT_THAT(transitions, IsEmpty());

  // The divergent microbatch itself: replicate, reason divergent.
  MicrobatchDecision d1 = engine.Decide({0, 1}, 0, {{1, 0}, {0, 0}}, &transitions);
  ExpectModule(d1, 0, "vision_tower", Decision::kReplicate, DecisionReason::kDivergent);
  ExpectModule(d1, 1, "audio_tower", Decision::kSkip, DecisionReason::kAllSkip);
  ASSERT_EQ(transitions.size(), 1u);
  EXPECT_EQ(transitions[0].module, "vision_tower");
  EXPECT_EQ(transitions[0].what, "sticky_replicate");
  EXPECT_THAT(transitions[0].detail, HasSubstr("(0,1)"));

  // Later microbatches, uniform, skipped or divergent: replicate, reason sticky_replicate.
  MicrobatchDecision d2 = engine.Decide({1, 0}, 0, {{1, 1}, {0, 0}}, &transitions);
  ExpectModule(d2, 0, "vision_tower", Decision::kReplicate, DecisionReason::kStickyReplicate);
  ExpectModule(d2, 1, "audio_tower", Decision::kSkip, DecisionReason::kAllSkip);
  MicrobatchDecision d3 = engine.Decide({1, 1}, 0, {{0, 0}, {1, 1}}, &transitions);
  ExpectModule(d3, 0, "vision_tower", Decision::kReplicate, DecisionReason::kStickyReplicate);
  ExpectModule(d3, 1, "audio_tower", Decision::kPerLayer, DecisionReason::kUniform);
  MicrobatchDecision d4 = engine.Decide({2, 0}, 0, {{0, 3}, {0, 0}}, &transitions);
  ExpectModule(d4, 0, "vision_tower", Decision::kReplicate, DecisionReason::kStickyReplicate);

  // Reported once only.
  EXPECT_THAT(Whats(transitions), ElementsAre("sticky_replicate"));
  EXPECT_THAT(engine.ReplicatedModules(), ElementsAre("vision_tower"));
}

TEST(DecisionEngineTest, AutoWithFallbackReplicateIsStickyAndNeverPromoted) {
  EngineConfig c = PromotionConfig(Policy::kAuto, Fallback::kReplicate);
  DecisionEngine engine(c);
  std::vector<EngineTransition> transitions;
  MicrobatchDecision d0 = engine.Decide({0, 0}, 0, kDivergent1, &transitions);
  ExpectModule(d0, 0, "vision_tower", Decision::kReplicate, DecisionReason::kDivergent);
  for (int i = 1; i < 6; ++i) {
    MicrobatchDecision d = engine.Decide({i, 0}, 0, kDivergent1, &transitions);
    ExpectModule(d, 0, "vision_tower", Decision::kReplicate, DecisionReason::kStickyReplicate);
  }
  EXPECT_THAT(Whats(transitions), ElementsAre("sticky_replicate"));
}

TEST(DecisionEngineTest, AutoPromotesAfterThresholdAndDemotesAfterQuietWindow) {
  DecisionEngine engine(PromotionConfig());
  std::vector<EngineTransition> t;

  // seq 0: first divergence, fallback root, no transition.
  MicrobatchDecision d0 = engine.Decide({0, 0}, 0, kDivergent1, &t);
  ExpectModule(d0, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
  EXPECT_THAT(t, IsEmpty());
  EXPECT_THAT(engine.ReplicatedModules(), IsEmpty());

  // seq 1: second divergence reaches the threshold. This microbatch is still fallback
  // root; "promoted" takes effect from the next one.
  MicrobatchDecision d1 = engine.Decide({0, 1}, 0, kDivergent1, &t);
  ExpectModule(d1, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].module, "vision_tower");
  EXPECT_EQ(t[0].what, "promoted");
  EXPECT_THAT(t[0].detail, HasSubstr("(0,1)"));
  EXPECT_THAT(engine.ReplicatedModules(), ElementsAre("vision_tower"));

  // seq 2..6: a uniform microbatch (the contract would gather: the window stays busy), then
  // all-skip ones, all replicated by promotion. The window is [T,T,T,F] at seq 3, then
  // [T,T,F,F], [T,F,F,F] and [F,F,F,F] at seq 6: demoted once it holds no gathering microbatch.
  MicrobatchDecision d2 = engine.Decide({1, 0}, 0, kUniform1, &t);
  ExpectModule(d2, 0, "vision_tower", Decision::kReplicate, DecisionReason::kPromoted);
  for (MicrobatchKey k : {MicrobatchKey{1, 1}, MicrobatchKey{2, 0}, MicrobatchKey{2, 1}}) {
    ExpectModule(engine.Decide(k, 0, kSkip1, &t), 0, "vision_tower", Decision::kReplicate,
                 DecisionReason::kPromoted);
  }
  EXPECT_THAT(Whats(t), ElementsAre("promoted"));  // Not demoted before the window is quiet.

  MicrobatchDecision d6 = engine.Decide({3, 0}, 0, kSkip1, &t);
  ExpectModule(d6, 0, "vision_tower", Decision::kReplicate, DecisionReason::kPromoted);
  ASSERT_THAT(Whats(t), ElementsAre("promoted", "demoted"));
  EXPECT_EQ(t[1].module, "vision_tower");
  EXPECT_THAT(t[1].detail, HasSubstr("(3,0)"));
  EXPECT_THAT(engine.ReplicatedModules(), IsEmpty());

  // Back to the per-microbatch rule.
  MicrobatchDecision d7 = engine.Decide({3, 1}, 0, kUniform1, &t);
  ExpectModule(d7, 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
  MicrobatchDecision d8 = engine.Decide({4, 0}, 0, kSkip1, &t);
  ExpectModule(d8, 0, "vision_tower", Decision::kSkip, DecisionReason::kAllSkip);
  MicrobatchDecision d9 = engine.Decide({4, 1}, 0, kDivergent1, &t);
  ExpectModule(d9, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
  // Two gathering microbatches in the window again: promoted from the next one.
  EXPECT_THAT(Whats(t), ElementsAre("promoted", "demoted", "promoted"));
}

TEST(DecisionEngineTest, UniformMicrobatchesPromoteToo) {
  // Every rank runs the tower: per_layer is safe, but a replica saves its gather every time.
  DecisionEngine engine(PromotionConfig());
  std::vector<EngineTransition> t;
  ExpectModule(engine.Decide({0, 0}, 0, kUniform1, &t), 0, "vision_tower", Decision::kPerLayer,
               DecisionReason::kUniform);
  ExpectModule(engine.Decide({0, 1}, 0, kUniform1, &t), 0, "vision_tower", Decision::kPerLayer,
               DecisionReason::kUniform);
  ASSERT_THAT(Whats(t), ElementsAre("promoted"));
  EXPECT_THAT(t[0].detail, HasSubstr("2 of the last 2 microbatches gathered it"));
  ExpectModule(engine.Decide({1, 0}, 0, kUniform1, &t), 0, "vision_tower", Decision::kReplicate,
               DecisionReason::kPromoted);
}

TEST(DecisionEngineTest, PromotedModuleStaysReplicatedWhileDivergenceContinues) {
  DecisionEngine engine(PromotionConfig());
  std::vector<EngineTransition> t;
  engine.Decide({0, 0}, 0, kDivergent1, &t);
  engine.Decide({0, 1}, 0, kDivergent1, &t);
  for (int i = 1; i <= 8; ++i) {
    MicrobatchDecision d = engine.Decide({i, 0}, 0, kDivergent1, &t);
    ExpectModule(d, 0, "vision_tower", Decision::kReplicate, DecisionReason::kPromoted);
  }
  EXPECT_THAT(Whats(t), ElementsAre("promoted"));
}

TEST(DecisionEngineTest, GathersOutsideTheWindowDoNotPromote) {
  // Window 4, threshold 2: gathering microbatches 4 apart (all-skip between) never share a window.
  DecisionEngine engine(PromotionConfig());
  std::vector<EngineTransition> t;
  for (int i = 0; i < 12; ++i) {
    const bool div = i % 8 == 0;
    const bool uniform = i % 8 == 4;
    MicrobatchDecision d = engine.Decide({i, 0}, 0, div ? kDivergent1 : uniform ? kUniform1 : kSkip1, &t);
    if (div) {
      ExpectModule(d, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
    } else if (uniform) {
      ExpectModule(d, 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
    } else {
      ExpectModule(d, 0, "vision_tower", Decision::kSkip, DecisionReason::kAllSkip);
    }
  }
  EXPECT_THAT(t, IsEmpty());
}

TEST(DecisionEngineTest, NoPromotionWhenMemoryBudgetIsZero) {
  EngineConfig c = PromotionConfig();
  c.min_memory_budget_bytes = 0;
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  for (int i = 0; i < 6; ++i) {
    MicrobatchDecision d = engine.Decide({i, 0}, 0, kDivergent1, &t);
    ExpectModule(d, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
  }
  EXPECT_THAT(t, IsEmpty());
  EXPECT_THAT(engine.ReplicatedModules(), IsEmpty());
}

TEST(DecisionEngineTest, NoPromotionWhenModuleExceedsBudget) {
  EngineConfig c = PromotionConfig();
  c.min_memory_budget_bytes = kTowerBytes - 1;
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  for (int i = 0; i < 6; ++i) {
    MicrobatchDecision d = engine.Decide({i, 0}, 0, kDivergent1, &t);
    ExpectModule(d, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
  }
  EXPECT_THAT(t, IsEmpty());
  EXPECT_THAT(engine.ReplicatedModules(), IsEmpty());
}

TEST(DecisionEngineTest, OnlyTheModuleThatFitsIsPromoted) {
  EngineConfig c = MakeConfig(Policy::kAuto, Fallback::kRoot);  // 1000 and 500 bytes.
  c.promotion.window = 4;
  c.promotion.promote_threshold = 2;
  c.promotion.demote_threshold = 0;
  c.min_memory_budget_bytes = 600;
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  engine.Decide({0, 0}, 0, {{1, 0}, {1, 0}}, &t);
  engine.Decide({0, 1}, 0, {{1, 0}, {1, 0}}, &t);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].module, "audio_tower");
  EXPECT_EQ(t[0].what, "promoted");
  MicrobatchDecision d = engine.Decide({1, 0}, 0, {{1, 1}, {1, 1}}, &t);
  ExpectModule(d, 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
  ExpectModule(d, 1, "audio_tower", Decision::kReplicate, DecisionReason::kPromoted);
  EXPECT_THAT(engine.ReplicatedModules(), ElementsAre("audio_tower"));
}

TEST(DecisionEngineTest, NoPromotionUnderExplicitPerLayer) {
  DecisionEngine engine(PromotionConfig(Policy::kPerLayer, Fallback::kRoot));
  std::vector<EngineTransition> t;
  for (int i = 0; i < 6; ++i) {
    MicrobatchDecision d = engine.Decide({i, 0}, 0, kDivergent1, &t);
    ExpectModule(d, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
  }
  EXPECT_THAT(t, IsEmpty());
  EXPECT_THAT(engine.ReplicatedModules(), IsEmpty());
}

TEST(DecisionEngineTest, TransitionsPointerMayBeNull) {
  DecisionEngine engine(PromotionConfig());
  engine.Decide({0, 0}, 0, kDivergent1);
  engine.Decide({0, 1}, 0, kDivergent1);
  // State still changes without a transitions sink.
  MicrobatchDecision d = engine.Decide({1, 0}, 0, kUniform1);
  ExpectModule(d, 0, "vision_tower", Decision::kReplicate, DecisionReason::kPromoted);
}

TEST(DecisionEngineTest, DecideStaticRootForEveryModuleTakesTheNextSeq) {
  DecisionEngine engine(MakeConfig(Policy::kRoot, Fallback::kReplicate));
  EXPECT_TRUE(engine.is_static());
  engine.Restore(/*next_seq=*/77, {}, {});
  MicrobatchDecision d = engine.DecideStatic({5, 3}, /*epoch=*/2);
  EXPECT_EQ(d.group, 2);
  EXPECT_EQ(d.key, (MicrobatchKey{5, 3}));
  EXPECT_EQ(d.seq, 77u);
  EXPECT_EQ(d.epoch, 2);
  ASSERT_EQ(d.modules.size(), 2u);
  ExpectModule(d, 0, "vision_tower", Decision::kRoot, DecisionReason::kStaticPolicy);
  ExpectModule(d, 1, "audio_tower", Decision::kRoot, DecisionReason::kStaticPolicy);
  EXPECT_EQ(d.digest, DecisionDigest(d));
  // One sequence for every policy: the next static decision takes the next seq.
  EXPECT_EQ(engine.next_seq(), 78u);
  EXPECT_EQ(engine.DecideStatic({5, 4}, 2).seq, 78u);
}

TEST(DecisionEngineTest, DecideStaticReplicatePolicy) {
  DecisionEngine engine(MakeConfig(Policy::kReplicate, Fallback::kRoot));
  EXPECT_TRUE(engine.is_static());
  MicrobatchDecision d = engine.DecideStatic({0, 0}, 0);
  EXPECT_EQ(d.seq, 0u);
  ExpectModule(d, 0, "vision_tower", Decision::kReplicate, DecisionReason::kStaticPolicy);
  ExpectModule(d, 1, "audio_tower", Decision::kReplicate, DecisionReason::kStaticPolicy);
}

TEST(DecisionEngineTest, StaticPolicyDecideIgnoresCalls) {
  DecisionEngine engine(MakeConfig(Policy::kRoot, Fallback::kRoot));
  MicrobatchDecision d = engine.Decide({0, 0}, 0, {{1, 0}, {0, 0}});
  ExpectModule(d, 0, "vision_tower", Decision::kRoot, DecisionReason::kStaticPolicy);
  ExpectModule(d, 1, "audio_tower", Decision::kRoot, DecisionReason::kStaticPolicy);
  EXPECT_FALSE(DecisionEngine(MakeConfig(Policy::kAuto, Fallback::kRoot)).is_static());
  EXPECT_FALSE(DecisionEngine(MakeConfig(Policy::kPerLayer, Fallback::kRoot)).is_static());
}

TEST(DecisionEngineTest, TwoEnginesFedTheSameSequenceDecideIdentically) {
  // A pseudo-random but fixed sequence of calls for two modules and three members,
  // exercising promotion and demotion on the way.
  EngineConfig c = MakeConfig(Policy::kAuto, Fallback::kRoot);
  c.promotion.window = 4;
  c.promotion.promote_threshold = 2;
  c.promotion.demote_threshold = 0;
  c.min_memory_budget_bytes = 2000;
  DecisionEngine a(c), b(c);
  std::vector<EngineTransition> ta, tb;
  uint32_t x = 12345;
  auto next = [&x] {
    x = x * 1103515245u + 12345u;
    return static_cast<int32_t>((x >> 16) % 3);
  };
  int promoted_seen = 0;
  for (int i = 0; i < 200; ++i) {
    Calls calls = {{next(), next(), next()}, {next(), next(), next()}};
    const MicrobatchKey key{i / 4, i % 4};
    MicrobatchDecision da = a.Decide(key, 0, calls, &ta);
    MicrobatchDecision db = b.Decide(key, 0, calls, &tb);
    ASSERT_EQ(da.digest, db.digest) << "at " << key;
    ASSERT_EQ(da.modules.size(), db.modules.size());
    for (size_t m = 0; m < da.modules.size(); ++m) {
      EXPECT_EQ(da.modules[m].decision, db.modules[m].decision);
      EXPECT_EQ(da.modules[m].reason, db.modules[m].reason);
      if (da.modules[m].reason == DecisionReason::kPromoted) ++promoted_seen;
    }
  }
  ASSERT_EQ(ta.size(), tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    EXPECT_EQ(ta[i].module, tb[i].module);
    EXPECT_EQ(ta[i].what, tb[i].what);
    EXPECT_EQ(ta[i].detail, tb[i].detail);
  }
  EXPECT_GT(promoted_seen, 0) << "the sequence should exercise promotion";
}

// ---- Cost-aware auto (DESIGN 3): the same engine once the group's members reported costs.

// PromotionConfig's module (1000 bytes in two units, window 4) with forward 10 ms a call and gathering 20 ms.
EngineConfig CostConfig(int64_t budget) {
  EngineConfig c = PromotionConfig();
  c.group_size = 2;
  c.min_memory_budget_bytes = budget;
  c.modules[0].units = {{"layers.0", 500}, {"layers.1", 500}};
  c.costs = {ModuleCostModel{0.010, 0.020}};
  return c;
}

TEST(DecisionEngineCostTest, RootWhenTheTowerRunsTwiceAndGatheringOnceIsCheaper) {
  DecisionEngine engine(CostConfig(/*budget=*/0));  // No budget: no replica; root fits.
  std::vector<EngineTransition> t;
  ExpectModule(engine.Decide({0, 0}, 0, {{1, 1}}, &t), 0, "vision_tower", Decision::kPerLayer,
               DecisionReason::kUniform);
  EXPECT_THAT(t, IsEmpty());
  ExpectModule(engine.Decide({0, 1}, 0, {{2, 2}}, &t), 0, "vision_tower", Decision::kRoot, DecisionReason::kCost);
  ASSERT_THAT(Whats(t), ElementsAre("cost_choice"));
  EXPECT_THAT(t[0].detail, HasSubstr("root 0.0400 s <= per_layer 0.0600 s for 2 call(s)"));
  ExpectModule(engine.Decide({0, 2}, 0, {{2, 2}}, &t), 0, "vision_tower", Decision::kRoot, DecisionReason::kCost);
  EXPECT_THAT(Whats(t), ElementsAre("cost_choice"));  // Said once, not per microbatch.
  for (int i = 0; i < 20; ++i) {  // Alternating shapes do not flood the journal either.
    ExpectModule(engine.Decide({1, 2 * i}, 0, {{1, 1}}, &t), 0, "vision_tower", Decision::kPerLayer,
                 DecisionReason::kUniform);
    ExpectModule(engine.Decide({1, 2 * i + 1}, 0, {{2, 2}}, &t), 0, "vision_tower", Decision::kRoot,
                 DecisionReason::kCost);
  }
  EXPECT_THAT(Whats(t), ElementsAre("cost_choice"));
  engine.SetCosts({ModuleCostModel{0.010, 0.030}});  // A new model: its choices are said again.
  engine.Decide({2, 0}, 0, {{2, 2}}, &t);
  EXPECT_THAT(Whats(t), ElementsAre("cost_choice", "cost_choice"));
}

TEST(DecisionEngineCostTest, ABudgetBelowTheTowerKeepsPerLayerAndNeverReplicates) {
  DecisionEngine engine(CostConfig(/*budget=*/600));  // A unit (500) fits, the tower (1000) not.
  std::vector<EngineTransition> t;
  for (int i = 0; i < 8; ++i) {
    ExpectModule(engine.Decide({i, 0}, 0, {{2, 2}}, &t), 0, "vision_tower", Decision::kPerLayer,
                 DecisionReason::kUniform);
  }
  // Divergent calls: root is the one placement that cannot hang, over the budget or not.
  ExpectModule(engine.Decide({8, 0}, 0, {{1, 0}}, &t), 0, "vision_tower", Decision::kRoot,
               DecisionReason::kDivergent);
  ASSERT_THAT(Whats(t), ElementsAre("cost_choice"));
  EXPECT_THAT(t[0].detail, HasSubstr("nothing safe fits the budget"));
  // Uniform calls when not even a unit fits: per_layer, the safe placement that holds the least.
  engine.SetMinMemoryBudget(100);
  ExpectModule(engine.Decide({9, 0}, 0, {{2, 2}}, &t), 0, "vision_tower", Decision::kPerLayer,
               DecisionReason::kUniform);
}

TEST(DecisionEngineCostTest, WithFallbackPaddedDivergentCallsOverTheBudgetArePaddedNotRoot) {
  EngineConfig c = CostConfig(/*budget=*/600);  // A unit (500) fits, the tower (1000) not.
  c.fallback = Fallback::kPadded;
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  MicrobatchDecision d = engine.Decide({0, 0}, 0, {{2, 0}}, &t);
  ExpectModule(d, 0, "vision_tower", Decision::kPadded, DecisionReason::kDivergent);
  EXPECT_EQ(d.modules[0].calls, 2);
  EXPECT_THAT(t, IsEmpty()) << "the rule's own choice: no override to announce";
  // Within the budget, gathering once is cheaper for two calls: root, by cost, with no passes.
  engine.SetMinMemoryBudget(0);
  d = engine.Decide({0, 1}, 0, {{2, 0}}, &t);
  ExpectModule(d, 0, "vision_tower", Decision::kRoot, DecisionReason::kCost);
  EXPECT_EQ(d.modules[0].calls, 0);
  ASSERT_THAT(Whats(t), ElementsAre("cost_choice"));
  EXPECT_THAT(t[0].detail, HasSubstr("root 0.0400 s <= padded 0.0600 s"));
}

TEST(DecisionEngineCostTest, PromotesWhenTheSavingsPayForTheReplicaAndDemotesWhenTheyStop) {
  DecisionEngine engine(CostConfig(/*budget=*/kTowerBytes));
  std::vector<EngineTransition> t;
  // One gathering microbatch saves 20 ms: as much as building the replica costs.
  ExpectModule(engine.Decide({0, 0}, 0, kDivergent1, &t), 0, "vision_tower", Decision::kRoot,
               DecisionReason::kDivergent);
  ASSERT_THAT(Whats(t), ElementsAre("promoted"));
  EXPECT_THAT(t[0].detail, HasSubstr("by cost: a replica would have saved 0.0200 s"));
  for (int i = 1; i <= 3; ++i) {
    ExpectModule(engine.Decide({i, 0}, 0, kSkip1, &t), 0, "vision_tower", Decision::kReplicate,
                 DecisionReason::kPromoted);
  }
  EXPECT_THAT(Whats(t), ElementsAre("promoted"));  // The window still holds the saving.
  engine.Decide({4, 0}, 0, kSkip1, &t);             // Four skips: nothing saved in the window.
  ASSERT_THAT(Whats(t), ElementsAre("promoted", "demoted"));
  ExpectModule(engine.Decide({5, 0}, 0, kSkip1, &t), 0, "vision_tower", Decision::kSkip, DecisionReason::kAllSkip);
}

TEST(DecisionEngineCostTest, AReplicaThatNoLongerFitsIsDemoted) {
  DecisionEngine engine(CostConfig(/*budget=*/kTowerBytes));
  std::vector<EngineTransition> t;
  engine.Decide({0, 0}, 0, kUniform1, &t);
  ASSERT_THAT(Whats(t), ElementsAre("promoted"));
  engine.SetMinMemoryBudget(kTowerBytes - 1);  // A member measured less room.
  ExpectModule(engine.Decide({1, 0}, 0, kUniform1, &t), 0, "vision_tower", Decision::kReplicate,
               DecisionReason::kPromoted);
  ASSERT_THAT(Whats(t), ElementsAre("promoted", "demoted"));
  EXPECT_THAT(t[1].detail, HasSubstr("it no longer fits"));
  ExpectModule(engine.Decide({2, 0}, 0, kUniform1, &t), 0, "vision_tower", Decision::kPerLayer,
               DecisionReason::kUniform);
}

TEST(DecisionEngineCostTest, WithoutMeasuresAutoCountsAsBefore) {
  EngineConfig c = CostConfig(kTowerBytes);
  c.costs = {ModuleCostModel{}};  // Reported nothing yet.
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  engine.Decide({0, 0}, 0, kDivergent1, &t);
  EXPECT_THAT(t, IsEmpty());  // The counting rule promotes at 2 of 4, not at the first.
  engine.Decide({0, 1}, 0, kDivergent1, &t);
  EXPECT_THAT(Whats(t), ElementsAre("promoted"));
  EXPECT_THAT(t[0].detail, Not(HasSubstr("by cost")));
}

TEST(DecisionEngineCostTest, AutoByCostFalseKeepsCountingWhateverIsReported) {
  EngineConfig c = CostConfig(0);
  c.promotion.by_cost = false;
  DecisionEngine engine(c);
  ExpectModule(engine.Decide({0, 0}, 0, {{2, 2}}), 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
}

TEST(DecisionEngineCostTest, AReplicaThatSavesNothingIsDemotedAfterAFullWindow) {
  // Promoted by counting before the costs arrived, on a group of one: gathering costs nothing
  // there, so once the members report, a full window shows the replica saves nothing.
  EngineConfig c = CostConfig(kTowerBytes);
  c.group_size = 1;
  c.costs = {ModuleCostModel{}};
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  engine.Decide({0, 0}, 0, {{1}}, &t);
  engine.Decide({0, 1}, 0, {{1}}, &t);
  ASSERT_THAT(Whats(t), ElementsAre("promoted"));
  engine.SetCosts({ModuleCostModel{0.010, 0.0}});
  for (int i = 0; i < 3; ++i) engine.Decide({1, i}, 0, {{1}}, &t);
  EXPECT_THAT(Whats(t), ElementsAre("promoted"));  // The window is not full yet.
  engine.Decide({1, 3}, 0, {{1}}, &t);
  ASSERT_THAT(Whats(t), ElementsAre("promoted", "demoted"));
  EXPECT_THAT(t[1].detail, HasSubstr("a replica would have saved 0.0000 s"));
}

TEST(DecisionEngineCostTest, PerLayerPolicyIgnoresCosts) {
  EngineConfig c = CostConfig(0);
  c.policy = Policy::kPerLayer;
  DecisionEngine engine(c);
  ExpectModule(engine.Decide({0, 0}, 0, {{2, 2}}), 0, "vision_tower", Decision::kPerLayer, DecisionReason::kUniform);
}

// ---- Trainable modules (DESIGN 10, "Towers that train"): skip, per_layer and root only.

TEST(DecisionEngineTrainableTest, FallbackPaddedOrReplicateGivesRootSaidOnceAndHoldsNoState) {
  for (Fallback fallback : {Fallback::kPadded, Fallback::kReplicate}) {
    EngineConfig c = MakeConfig(Policy::kPerLayer, fallback);
    c.modules[0].trainable = true;  // vision_tower trains; audio_tower stays frozen.
    DecisionEngine engine(c);
    std::vector<EngineTransition> t;
    MicrobatchDecision d0 = engine.Decide({0, 0}, 0, {{2, 1}, {1, 0}}, &t);
    ExpectModule(d0, 0, "vision_tower", Decision::kRoot, DecisionReason::kDivergent);
    EXPECT_EQ(d0.modules[0].calls, 0);
    const Decision frozen = fallback == Fallback::kPadded ? Decision::kPadded : Decision::kReplicate;
    ExpectModule(d0, 1, "audio_tower", frozen, DecisionReason::kDivergent);
    ASSERT_FALSE(t.empty());
    EXPECT_EQ(t[0].module, "vision_tower");
    EXPECT_EQ(t[0].what, "trainable_root");
    EXPECT_THAT(t[0].detail, HasSubstr(std::string("root instead of ") + DecisionName(frozen)));
    // Uniform and all-skip microbatches keep the contract's rule: no sticky replica for the trainable one.
    ExpectModule(engine.Decide({0, 1}, 0, {{1, 1}, {0, 0}}, &t), 0, "vision_tower", Decision::kPerLayer,
                 DecisionReason::kUniform);
    ExpectModule(engine.Decide({0, 2}, 0, {{0, 0}, {0, 0}}, &t), 0, "vision_tower", Decision::kSkip,
                 DecisionReason::kAllSkip);
    ExpectModule(engine.Decide({0, 3}, 0, {{0, 3}, {0, 0}}, &t), 0, "vision_tower", Decision::kRoot,
                 DecisionReason::kDivergent);
    const std::vector<std::string> whats = Whats(t);
    EXPECT_EQ(std::count(whats.begin(), whats.end(), "trainable_root"), 1) << FallbackName(fallback);
    const std::vector<std::string> replicated = engine.ReplicatedModules();
    EXPECT_EQ(std::count(replicated.begin(), replicated.end(), "vision_tower"), 0);
  }
}

TEST(DecisionEngineTrainableTest, NeverPromotedByCountingOrByCost) {
  EngineConfig c = PromotionConfig();
  c.modules[0].trainable = true;
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  for (int i = 0; i < 8; ++i) {
    ExpectModule(engine.Decide({i, 0}, 0, kDivergent1, &t), 0, "vision_tower", Decision::kRoot,
                 DecisionReason::kDivergent);
  }
  EXPECT_THAT(t, IsEmpty());  // The frozen module of PromotionConfigs's tests is promoted at the second.
  EngineConfig by_cost = CostConfig(/*budget=*/1 << 20);
  by_cost.modules[0].trainable = true;
  DecisionEngine costed(by_cost);
  for (int i = 0; i < 8; ++i) {
    const MicrobatchDecision d = costed.Decide({i, 0}, 0, {{1, 1}}, &t);
    EXPECT_NE(d.modules[0].decision, Decision::kReplicate) << "microbatch " << i;
  }
  EXPECT_THAT(Whats(t), Not(::testing::Contains("promoted")));
  EXPECT_THAT(costed.ReplicatedModules(), IsEmpty());
}

TEST(DecisionEngineTrainableTest, StaticReplicateIsRootForATrainableModule) {
  EngineConfig c = MakeConfig(Policy::kReplicate, Fallback::kRoot);
  c.modules[1].trainable = true;
  DecisionEngine engine(c);
  std::vector<EngineTransition> t;
  MicrobatchDecision d = engine.DecideStatic({0, 0}, 0, &t);
  ExpectModule(d, 0, "vision_tower", Decision::kReplicate, DecisionReason::kStaticPolicy);
  ExpectModule(d, 1, "audio_tower", Decision::kRoot, DecisionReason::kStaticPolicy);
  ExpectModule(engine.DecideStatic({0, 1}, 0, &t), 1, "audio_tower", Decision::kRoot, DecisionReason::kStaticPolicy);
  EXPECT_THAT(Whats(t), ElementsAre("trainable_root"));  // Said once.
}

}  // namespace
