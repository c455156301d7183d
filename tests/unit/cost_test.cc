// Unit tests of shardcoord/cost.h: the estimate of each placement, the cost-aware choice and
// what a replica saves (DESIGN 3, "Cost-aware auto").
#include "shardcoord/cost.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace {

using namespace shardcoord;
using ::testing::HasSubstr;

// A 1000-byte module of two 500-byte units; forward 10 ms a call, gathering it 20 ms.
class CostTest : public ::testing::Test {
 protected:
  CostTest() {
    spec_ = ModuleSpec{"tower", 1000, {{"blocks.0", 500}, {"blocks.1", 500}}};
    in_.spec = &spec_;
    in_.cost.forward_seconds_per_call = 0.010;
    in_.cost.gather_seconds = 0.020;
    in_.group_size = 2;
  }
  ModuleSpec spec_;
  CostInputs in_;
};

TEST_F(CostTest, PerLayersPeakIsTheRestUnitBesideTheLargestLayer) {
  // The probe: rest 900 + layers of 100 were priced at 900 (the largest unit); a call holds 1000.
  spec_ = ModuleSpec{"tower", 1100, {{"", 900}, {"blocks.0", 100}, {"blocks.1", 100}}};
  EXPECT_EQ(EstimatePlacement(in_, Decision::kPerLayer, {1, 1}).peak_bytes, 1000);
  EXPECT_EQ(EstimatePlacement(in_, Decision::kPadded, {1, 2}).peak_bytes, 1000);
  spec_ = ModuleSpec{"tower", 1100, {}};  // No units: gathered whole.
  EXPECT_EQ(EstimatePlacement(in_, Decision::kPerLayer, {1, 1}).peak_bytes, 1100);
}

TEST_F(CostTest, EachPlacementCostsWhatTheModelSays) {
  const std::vector<int32_t> twice = {2, 2};
  PlacementEstimate per_layer = EstimatePlacement(in_, Decision::kPerLayer, twice);
  EXPECT_TRUE(per_layer.safe);
  EXPECT_DOUBLE_EQ(per_layer.seconds, 2 * (0.020 + 0.010));  // Each call gathers again.
  EXPECT_EQ(per_layer.gathered_bytes, 2000);
  EXPECT_EQ(per_layer.peak_bytes, 500);  // The largest unit.
  PlacementEstimate root = EstimatePlacement(in_, Decision::kRoot, twice);
  EXPECT_DOUBLE_EQ(root.seconds, 0.020 + 2 * 0.010);  // Gathered once.
  EXPECT_EQ(root.gathered_bytes, 1000);
  EXPECT_EQ(root.peak_bytes, 1000);
  PlacementEstimate replica = EstimatePlacement(in_, Decision::kReplicate, twice);
  EXPECT_DOUBLE_EQ(replica.seconds, 0.020 + 2 * 0.010);  // Built in this microbatch.
  in_.replica_resident = true;
  replica = EstimatePlacement(in_, Decision::kReplicate, twice);
  EXPECT_DOUBLE_EQ(replica.seconds, 2 * 0.010);
  EXPECT_EQ(replica.gathered_bytes, 0);
}

TEST_F(CostTest, PerLayerAndSkipAreSafeOnlyWhenTheRanksAgree) {
  EXPECT_FALSE(EstimatePlacement(in_, Decision::kPerLayer, {1, 0}).safe);
  EXPECT_FALSE(EstimatePlacement(in_, Decision::kSkip, {1, 0}).safe);
  EXPECT_TRUE(EstimatePlacement(in_, Decision::kSkip, {0, 0}).safe);
  EXPECT_TRUE(EstimatePlacement(in_, Decision::kRoot, {1, 0}).safe);
  // The slowest rank sets the time: root runs 3 calls on one rank.
  EXPECT_DOUBLE_EQ(EstimatePlacement(in_, Decision::kRoot, {3, 0}).seconds, 0.020 + 3 * 0.010);
}

TEST_F(CostTest, AGroupOfOneGathersNothing) {
  in_.group_size = 1;
  EXPECT_EQ(EstimatePlacement(in_, Decision::kRoot, {1}).gathered_bytes, 0);
}

TEST_F(CostTest, WithNothingMeasuredTheChoiceIsTheContractsRule) {
  in_.cost = {};
  EXPECT_EQ(ChooseByCost(in_, {2, 2}).chosen.decision, Decision::kPerLayer);  // Lower peak.
  EXPECT_EQ(ChooseByCost(in_, {0, 0}).chosen.decision, Decision::kSkip);
  EXPECT_EQ(ChooseByCost(in_, {1, 0}).chosen.decision, Decision::kRoot);
}

TEST_F(CostTest, RootWinsWhenTheModuleRunsMoreThanOnceAndFits) {
  EXPECT_EQ(ChooseByCost(in_, {1, 1}).chosen.decision, Decision::kPerLayer);  // Equal time, lower peak.
  CostChoice twice = ChooseByCost(in_, {2, 2});
  EXPECT_EQ(twice.chosen.decision, Decision::kRoot);
  EXPECT_FALSE(twice.over_budget);
  EXPECT_THAT(DescribeChoice(twice, in_, 2), HasSubstr("root 0.0400 s <= per_layer 0.0600 s for 2 call(s)"));
  in_.budget_bytes = 999;  // Root's peak does not fit: per_layer, although slower.
  EXPECT_EQ(ChooseByCost(in_, {2, 2}).chosen.decision, Decision::kPerLayer);
}

TEST_F(CostTest, DivergentCallsOverTheBudgetStillGetRootAndSaySo) {
  in_.budget_bytes = 600;
  CostChoice c = ChooseByCost(in_, {1, 0});
  EXPECT_EQ(c.chosen.decision, Decision::kRoot);
  EXPECT_TRUE(c.over_budget);
  EXPECT_THAT(DescribeChoice(c, in_, 1), HasSubstr("nothing safe fits the budget"));
  in_.budget_bytes = 100;  // Not even a unit fits: uniform calls get the lowest peak, per_layer.
  CostChoice uniform = ChooseByCost(in_, {2, 2});
  EXPECT_EQ(uniform.chosen.decision, Decision::kPerLayer);
  EXPECT_TRUE(uniform.over_budget);
}

TEST_F(CostTest, PaddedCostsTheBusiestRanksPerLayerTimeAtOneUnit) {
  PlacementEstimate padded = EstimatePlacement(in_, Decision::kPadded, {2, 0});
  EXPECT_TRUE(padded.safe);
  EXPECT_DOUBLE_EQ(padded.seconds, 2 * (0.020 + 0.010));  // Two passes, each gathering again.
  EXPECT_EQ(padded.gathered_bytes, 2000);                 // On every rank: passes gather too.
  EXPECT_EQ(padded.peak_bytes, 500);
}

TEST_F(CostTest, PaddedIsChosenOnlyWhereTheGroupPadsAndRootDoesNotFitOrTies) {
  in_.budget_bytes = 600;  // Root (1000 bytes) does not fit; a unit (500) does.
  EXPECT_TRUE(ChooseByCost(in_, {2, 0}).over_budget) << "without padding, divergent calls get root over budget";
  in_.can_pad = true;
  CostChoice c = ChooseByCost(in_, {2, 0});
  EXPECT_EQ(c.chosen.decision, Decision::kPadded);
  EXPECT_FALSE(c.over_budget);
  EXPECT_THAT(DescribeChoice(c, in_, 2), HasSubstr("padded 0.0600 s > root 0.0400 s for 2 call(s)"));
  in_.budget_bytes = 0;  // Everything fits: root gathers once, padded twice.
  c = ChooseByCost(in_, {2, 0});
  EXPECT_EQ(c.chosen.decision, Decision::kRoot);
  EXPECT_THAT(DescribeChoice(c, in_, 2), HasSubstr("root 0.0400 s <= padded 0.0600 s"));
  // One call: the same time, one unit instead of the module.
  EXPECT_EQ(ChooseByCost(in_, {1, 0}).chosen.decision, Decision::kPadded);
  // Uniform calls stay per_layer (the same time and peak, and first in the order).
  EXPECT_EQ(ChooseByCost(in_, {1, 1}).chosen.decision, Decision::kPerLayer);
}

TEST_F(CostTest, AReplicaSavesTheGathersOfTheCheapestOtherChoice) {
  EXPECT_DOUBLE_EQ(ReplicaSaving(in_, {0, 0}), 0);
  EXPECT_DOUBLE_EQ(ReplicaSaving(in_, {1, 1}), 0.020);
  EXPECT_DOUBLE_EQ(ReplicaSaving(in_, {2, 2}), 0.020);  // Against root, which gathers once.
  EXPECT_DOUBLE_EQ(ReplicaSaving(in_, {1, 0}), 0.020);
  in_.budget_bytes = 1;  // The saving is time alone; the engine checks the fit.
  EXPECT_DOUBLE_EQ(ReplicaSaving(in_, {1, 0}), 0.020);
}

TEST(ModuleCostModelTest, TakesTheSlowestMembersMeasures) {
  ModuleCostModel m;
  EXPECT_FALSE(m.Known());
  m.Take(ModuleCost{"tower", 0.010, {{"blocks.0", 500, 0.004}, {"blocks.1", 500, 0.006}}});
  m.Take(ModuleCost{"tower", 0.008, {{"blocks.0", 500, 0.012}}});
  EXPECT_TRUE(m.Known());
  EXPECT_DOUBLE_EQ(m.forward_seconds_per_call, 0.010);
  EXPECT_DOUBLE_EQ(m.gather_seconds, 0.012);
}

}  // namespace
