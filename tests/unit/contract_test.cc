// Unit tests of the shared contract library: types.h (names, parsing, keys), classify.h
// (which modules are controlled, DESIGN 3 "Classification") and decide.h (the decision
// rule and the decision digest, DESIGN 3 "Decision").
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "shardcoord/classify.h"
#include "shardcoord/decide.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/types.h"

namespace {

using namespace shardcoord;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::Field;
using ::testing::IsEmpty;

// The lists of DESIGN 3, written out here so that a change to the library's lists fails.
const std::vector<std::string> kTowerNames = {
    "visual",         "vision_tower", "vision_model",  "vit_model",  "image_encoder",
    "vision_encoder", "audio_tower",  "audio_encoder", "audio_model"};
const std::vector<std::string> kProjectorNames = {
    "embed_vision",          "embed_audio",      "mm_projector",
    "multi_modal_projector", "multimodal_projector", "vision_projector",
    "vit_large_projector",   "audio_projector",  "connector"};

ModuleNode Frozen(const std::string& path, int64_t params = 4) {
  return ModuleNode{path, params, 0};
}

std::vector<std::string> Paths(const std::vector<ClassifiedModule>& picked) {
  std::vector<std::string> out;
  for (const auto& m : picked) out.push_back(m.path);
  return out;
}

// ---------------------------------------------------------------------------------------
// Classification

TEST(BuiltinNamesTest, TowerListMatchesDesignInSeedOrder) {
  EXPECT_THAT(BuiltinTowerNames(), ElementsAreArray(kTowerNames));
}

TEST(BuiltinNamesTest, ProjectorListMatchesDesignInSeedOrder) {
  EXPECT_THAT(BuiltinProjectorNames(), ElementsAreArray(kProjectorNames));
}

TEST(ClassifyTest, EveryBuiltinTowerNameIsClassifiedAsTower) {
  for (const std::string& name : kTowerNames) {
    SCOPED_TRACE(name);
    const std::string path = "model." + name;
    auto picked = ClassifyModules({Frozen("model"), Frozen(path)});
    ASSERT_EQ(picked.size(), 1u);
    EXPECT_EQ(picked[0].path, path);
    EXPECT_EQ(picked[0].kind, ModuleKind::kTower);
    EXPECT_TRUE(picked[0].fully_frozen);

    ModuleKind kind = ModuleKind::kProjector;
    EXPECT_TRUE(MatchModuleName(path, {}, &kind));
    EXPECT_EQ(kind, ModuleKind::kTower);
  }
}

TEST(ClassifyTest, EveryBuiltinProjectorNameIsClassifiedAsProjector) {
  for (const std::string& name : kProjectorNames) {
    SCOPED_TRACE(name);
    const std::string path = "model." + name;
    auto picked = ClassifyModules({Frozen("model"), Frozen(path)});
    ASSERT_EQ(picked.size(), 1u);
    EXPECT_EQ(picked[0].path, path);
    EXPECT_EQ(picked[0].kind, ModuleKind::kProjector);
    EXPECT_TRUE(picked[0].fully_frozen);

    ModuleKind kind = ModuleKind::kTower;
    EXPECT_TRUE(MatchModuleName(path, {}, &kind));
    EXPECT_EQ(kind, ModuleKind::kProjector);
  }
}

TEST(ClassifyTest, TopLevelNameWithoutDotsMatches) {
  auto picked = ClassifyModules({Frozen(""), Frozen("visual")});
  ASSERT_EQ(picked.size(), 1u);
  EXPECT_EQ(picked[0].path, "visual");
  EXPECT_EQ(picked[0].kind, ModuleKind::kTower);
}

TEST(ClassifyTest, MatchesOnlyTheExactLastPathComponent) {
  auto picked = ClassifyModules({
      Frozen("model"),
      Frozen("model.vision_tower"),        // Last component matches: picked.
      Frozen("model.vision_tower_extra"),  // Name only starts with a tower name.
      Frozen("model.my_vision_tower"),     // Name only ends with a tower name.
      Frozen("vision"),                    // Not a listed name.
      Frozen("model.vision_tower2"),
      Frozen("model.Visual"),              // Case matters.
  });
  EXPECT_THAT(Paths(picked), ElementsAre("model.vision_tower"));
}

TEST(ClassifyTest, EarlierComponentNamingATowerDoesNotMakeAModuleACandidate) {
  // "visual.proj": the last component is "proj", so only "visual" itself can match.
  ModuleKind kind;
  EXPECT_FALSE(MatchModuleName("visual.proj", {}, &kind));
  EXPECT_FALSE(MatchModuleName("vision_tower.layers.0", {}, &kind));
  EXPECT_FALSE(MatchModuleName("", {}, &kind));
  EXPECT_FALSE(MatchModuleName("model.", {}, &kind));
  EXPECT_TRUE(MatchModuleName("a.b.c.audio_tower", {}, &kind));
  EXPECT_EQ(kind, ModuleKind::kTower);
}

TEST(ClassifyTest, CandidateBelowAPickedCandidateIsNotPickedAgain) {
  // vision_tower.vision_model's last component is a tower name, but its parent is picked.
  auto picked = ClassifyModules({
      Frozen(""),
      Frozen("vision_tower", 10),
      Frozen("vision_tower.vision_model", 8),
      Frozen("vision_tower.vision_model.encoder", 8),
      Frozen("vision_tower.multi_modal_projector", 2),
  });
  ASSERT_EQ(picked.size(), 1u);
  EXPECT_EQ(picked[0].path, "vision_tower");
  EXPECT_EQ(picked[0].kind, ModuleKind::kTower);
  EXPECT_TRUE(picked[0].fully_frozen);
}

TEST(ClassifyTest, CandidateNestedUnderANonCandidateIsPicked) {
  auto picked = ClassifyModules({
      Frozen("model"),
      Frozen("model.language_model"),
      Frozen("model.language_model.visual"),
      Frozen("model.language_model.layers"),
  });
  ASSERT_EQ(picked.size(), 1u);
  EXPECT_EQ(picked[0].path, "model.language_model.visual");
  EXPECT_EQ(picked[0].kind, ModuleKind::kTower);
}

TEST(ClassifyTest, SiblingWhosePathSharesAPrefixIsNotTreatedAsNested) {
  // "model.visual_extra" is not below "model.visual" (no '.' after the prefix), so the
  // tower inside it is picked on its own.
  auto picked = ClassifyModules({
      Frozen("model.visual"),
      Frozen("model.visual_extra"),
      Frozen("model.visual_extra.vision_model"),
  });
  EXPECT_THAT(Paths(picked), ElementsAre("model.visual", "model.visual_extra.vision_model"));
}

TEST(ClassifyTest, InputOrderDoesNotMatterChildrenBeforeParents) {
  const std::vector<ModuleNode> parents_first = {
      Frozen(""),
      Frozen("model"),
      Frozen("model.vision_tower"),
      Frozen("model.vision_tower.vision_model"),
      Frozen("model.multi_modal_projector"),
      Frozen("model.audio_tower"),
  };
  const std::vector<ModuleNode> children_first = {
      Frozen("model.vision_tower.vision_model"),
      Frozen("model.audio_tower"),
      Frozen("model.multi_modal_projector"),
      Frozen("model.vision_tower"),
      Frozen("model"),
      Frozen(""),
  };
  auto a = ClassifyModules(parents_first);
  auto b = ClassifyModules(children_first);
  // Returned in path order, the nested vision_model never picked.
  EXPECT_THAT(Paths(a), ElementsAre("model.audio_tower", "model.multi_modal_projector",
                                    "model.vision_tower"));
  EXPECT_EQ(Paths(a), Paths(b));
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].kind, ModuleKind::kTower);
  EXPECT_EQ(b[1].kind, ModuleKind::kProjector);
  EXPECT_EQ(b[2].kind, ModuleKind::kTower);
}

TEST(ClassifyTest, FullyFrozenNeedsParamsAndNoTrainable) {
  auto picked = ClassifyModules({
      ModuleNode{"a.visual", 3, 0},        // Frozen: controlled.
      ModuleNode{"b.visual", 0, 0},        // No parameters: not fully frozen.
      ModuleNode{"c.visual", 3, 1},        // One trainable: not fully frozen.
      ModuleNode{"d.mm_projector", 5, 5},  // All trainable.
  });
  ASSERT_EQ(picked.size(), 4u);  // Trainable candidates are still returned for logging.
  EXPECT_EQ(picked[0].path, "a.visual");
  EXPECT_TRUE(picked[0].fully_frozen);
  EXPECT_EQ(picked[1].path, "b.visual");
  EXPECT_FALSE(picked[1].fully_frozen);
  EXPECT_EQ(picked[2].path, "c.visual");
  EXPECT_FALSE(picked[2].fully_frozen);
  EXPECT_EQ(picked[3].path, "d.mm_projector");
  EXPECT_EQ(picked[3].kind, ModuleKind::kProjector);
  EXPECT_FALSE(picked[3].fully_frozen);
}

TEST(ClassifyTest, NoCandidatesGivesEmptyResult) {
  EXPECT_THAT(ClassifyModules({Frozen(""), Frozen("model"), Frozen("model.lm_head")}),
              IsEmpty());
  EXPECT_THAT(ClassifyModules({}), IsEmpty());
}

TEST(ClassifyTest, ExtraTowerAndProjectorNamesFromOptions) {
  ClassifyOptions options;
  options.extra_tower_names = {"speech_encoder"};
  options.extra_projector_names = {"speech_adapter"};
  const std::vector<ModuleNode> nodes = {
      Frozen("model.speech_encoder"), Frozen("model.speech_adapter"), Frozen("model.visual")};

  auto without = ClassifyModules(nodes);
  EXPECT_THAT(Paths(without), ElementsAre("model.visual"));

  auto with = ClassifyModules(nodes, options);
  ASSERT_EQ(with.size(), 3u);
  EXPECT_EQ(with[0].path, "model.speech_adapter");
  EXPECT_EQ(with[0].kind, ModuleKind::kProjector);
  EXPECT_EQ(with[1].path, "model.speech_encoder");
  EXPECT_EQ(with[1].kind, ModuleKind::kTower);
  EXPECT_EQ(with[2].path, "model.visual");  // Built-ins still apply.
  EXPECT_EQ(with[2].kind, ModuleKind::kTower);

  ModuleKind kind = ModuleKind::kTower;
  EXPECT_TRUE(MatchModuleName("x.speech_adapter", options, &kind));
  EXPECT_EQ(kind, ModuleKind::kProjector);
  EXPECT_FALSE(MatchModuleName("x.speech_adapter", {}, &kind));
}

TEST(ClassifyTest, ExtraNamesAlsoObeyNesting) {
  ClassifyOptions options;
  options.extra_tower_names = {"speech_encoder"};
  auto picked = ClassifyModules(
      {Frozen("model.speech_encoder.visual"), Frozen("model.speech_encoder")}, options);
  EXPECT_THAT(Paths(picked), ElementsAre("model.speech_encoder"));
}

// ---------------------------------------------------------------------------------------
// ApplyContract

TEST(ApplyContractTest, RootPolicyIsRootWhateverTheCalls) {
  for (const std::vector<int32_t>& calls :
       std::vector<std::vector<int32_t>>{{}, {0, 0}, {1, 1}, {1, 0}, {3, 2, 0}}) {
    for (Fallback fb : {Fallback::kRoot, Fallback::kReplicate}) {
      RuleOutcome r = ApplyContract(Policy::kRoot, fb, calls);
      EXPECT_EQ(r.decision, Decision::kRoot);
      EXPECT_EQ(r.reason, DecisionReason::kStaticPolicy);
    }
  }
}

TEST(ApplyContractTest, ReplicatePolicyIsReplicateWhateverTheCalls) {
  for (const std::vector<int32_t>& calls :
       std::vector<std::vector<int32_t>>{{}, {0, 0}, {1, 1}, {1, 0}, {3, 2, 0}}) {
    for (Fallback fb : {Fallback::kRoot, Fallback::kReplicate}) {
      RuleOutcome r = ApplyContract(Policy::kReplicate, fb, calls);
      EXPECT_EQ(r.decision, Decision::kReplicate);
      EXPECT_EQ(r.reason, DecisionReason::kStaticPolicy);
    }
  }
}

class DynamicPolicyTest : public ::testing::TestWithParam<Policy> {};

TEST_P(DynamicPolicyTest, AllZeroIsSkip) {
  for (Fallback fb : {Fallback::kRoot, Fallback::kReplicate}) {
    RuleOutcome r = ApplyContract(GetParam(), fb, {0, 0, 0, 0});
    EXPECT_EQ(r.decision, Decision::kSkip);
    EXPECT_EQ(r.reason, DecisionReason::kAllSkip);
  }
}

TEST_P(DynamicPolicyTest, AllEqualPositiveIsPerLayer) {
  for (Fallback fb : {Fallback::kRoot, Fallback::kReplicate}) {
    RuleOutcome r = ApplyContract(GetParam(), fb, {2, 2, 2});
    EXPECT_EQ(r.decision, Decision::kPerLayer);
    EXPECT_EQ(r.reason, DecisionReason::kUniform);
    r = ApplyContract(GetParam(), fb, {1, 1});
    EXPECT_EQ(r.decision, Decision::kPerLayer);
    EXPECT_EQ(r.reason, DecisionReason::kUniform);
  }
}

TEST_P(DynamicPolicyTest, DivergentGoesToFallbackRoot) {
  for (const std::vector<int32_t>& calls :
       std::vector<std::vector<int32_t>>{{1, 0}, {1, 2}, {0, 3}, {2, 2, 1}}) {
    RuleOutcome r = ApplyContract(GetParam(), Fallback::kRoot, calls);
    EXPECT_EQ(r.decision, Decision::kRoot);
    EXPECT_EQ(r.reason, DecisionReason::kDivergent);
  }
}

TEST_P(DynamicPolicyTest, DivergentGoesToFallbackReplicate) {
  for (const std::vector<int32_t>& calls :
       std::vector<std::vector<int32_t>>{{1, 0}, {1, 2}, {0, 3}, {2, 2, 1}}) {
    RuleOutcome r = ApplyContract(GetParam(), Fallback::kReplicate, calls);
    EXPECT_EQ(r.decision, Decision::kReplicate);
    EXPECT_EQ(r.reason, DecisionReason::kDivergent);
  }
}

TEST_P(DynamicPolicyTest, DivergentGoesToFallbackPaddedToTheBusiestRank) {
  for (const auto& [calls, most] : std::vector<std::pair<std::vector<int32_t>, int32_t>>{
           {{1, 0}, 1}, {{1, 2}, 2}, {{0, 3}, 3}, {{2, 2, 1}, 2}}) {
    RuleOutcome r = ApplyContract(GetParam(), Fallback::kPadded, calls);
    EXPECT_EQ(r.decision, Decision::kPadded);
    EXPECT_EQ(r.reason, DecisionReason::kDivergent);
    EXPECT_EQ(r.calls, most);
  }
  // Uniform and all-zero calls are not padded: per_layer and skip, with no passes.
  EXPECT_EQ(ApplyContract(GetParam(), Fallback::kPadded, {2, 2}).decision, Decision::kPerLayer);
  EXPECT_EQ(ApplyContract(GetParam(), Fallback::kPadded, {2, 2}).calls, 0);
  EXPECT_EQ(ApplyContract(GetParam(), Fallback::kPadded, {0, 0}).decision, Decision::kSkip);
}

TEST_P(DynamicPolicyTest, SingleRankGroupIsNeverDivergent) {
  RuleOutcome r = ApplyContract(GetParam(), Fallback::kRoot, {0});
  EXPECT_EQ(r.decision, Decision::kSkip);
  EXPECT_EQ(r.reason, DecisionReason::kAllSkip);
  r = ApplyContract(GetParam(), Fallback::kRoot, {5});
  EXPECT_EQ(r.decision, Decision::kPerLayer);
  EXPECT_EQ(r.reason, DecisionReason::kUniform);
}

INSTANTIATE_TEST_SUITE_P(PerLayerAndAuto, DynamicPolicyTest,
                         ::testing::Values(Policy::kPerLayer, Policy::kAuto),
                         [](const ::testing::TestParamInfo<Policy>& info) {
                           return std::string(PolicyName(info.param));
                         });

TEST(IsStaticPolicyTest, OnlyRootAndReplicateAreStatic) {
  EXPECT_TRUE(IsStaticPolicy(Policy::kRoot));
  EXPECT_TRUE(IsStaticPolicy(Policy::kReplicate));
  EXPECT_FALSE(IsStaticPolicy(Policy::kAuto));
  EXPECT_FALSE(IsStaticPolicy(Policy::kPerLayer));
  EXPECT_FALSE(IsStaticPolicy(Policy::kUnspecified));
}

// ---------------------------------------------------------------------------------------
// Names and parsing

TEST(NamesTest, PolicyNamesRoundTrip) {
  EXPECT_STREQ(PolicyName(Policy::kAuto), "auto");
  EXPECT_STREQ(PolicyName(Policy::kPerLayer), "per_layer");
  EXPECT_STREQ(PolicyName(Policy::kRoot), "root");
  EXPECT_STREQ(PolicyName(Policy::kReplicate), "replicate");
  for (Policy p : {Policy::kAuto, Policy::kPerLayer, Policy::kRoot, Policy::kReplicate}) {
    EXPECT_EQ(ParsePolicy(PolicyName(p)), p) << PolicyName(p);
  }
  EXPECT_EQ(ParsePolicy("bogus"), std::nullopt);
  EXPECT_EQ(ParsePolicy(""), std::nullopt);
  EXPECT_EQ(ParsePolicy("unspecified"), std::nullopt);
  EXPECT_EQ(ParsePolicy("Root"), std::nullopt);
  EXPECT_EQ(ParsePolicy("skip"), std::nullopt);  // A decision, not a policy.
}

TEST(NamesTest, FallbackNamesRoundTrip) {
  EXPECT_STREQ(FallbackName(Fallback::kRoot), "root");
  EXPECT_STREQ(FallbackName(Fallback::kReplicate), "replicate");
  EXPECT_STREQ(FallbackName(Fallback::kPadded), "padded");
  for (Fallback f : {Fallback::kRoot, Fallback::kReplicate, Fallback::kPadded}) {
    EXPECT_EQ(ParseFallback(FallbackName(f)), f) << FallbackName(f);
  }
  EXPECT_EQ(ParseFallback("auto"), std::nullopt);
  EXPECT_EQ(ParseFallback("per_layer"), std::nullopt);
  EXPECT_EQ(ParseFallback("unspecified"), std::nullopt);
  EXPECT_EQ(ParseFallback(""), std::nullopt);
}

TEST(NamesTest, DecisionNamesRoundTrip) {
  EXPECT_STREQ(DecisionName(Decision::kPerLayer), "per_layer");
  EXPECT_STREQ(DecisionName(Decision::kSkip), "skip");
  EXPECT_STREQ(DecisionName(Decision::kRoot), "root");
  EXPECT_STREQ(DecisionName(Decision::kReplicate), "replicate");
  EXPECT_STREQ(DecisionName(Decision::kPadded), "padded");
  for (Decision d : {Decision::kPerLayer, Decision::kSkip, Decision::kRoot, Decision::kReplicate, Decision::kPadded}) {
    EXPECT_EQ(ParseDecision(DecisionName(d)), d) << DecisionName(d);
  }
  EXPECT_EQ(ParseDecision("auto"), std::nullopt);
  EXPECT_EQ(ParseDecision("unspecified"), std::nullopt);
  EXPECT_EQ(ParseDecision("bogus"), std::nullopt);
}

TEST(NamesTest, DecisionReasonNames) {
  EXPECT_STREQ(DecisionReasonName(DecisionReason::kStaticPolicy), "static_policy");
  EXPECT_STREQ(DecisionReasonName(DecisionReason::kUniform), "uniform");
  EXPECT_STREQ(DecisionReasonName(DecisionReason::kAllSkip), "all_skip");
  EXPECT_STREQ(DecisionReasonName(DecisionReason::kDivergent), "divergent");
  EXPECT_STREQ(DecisionReasonName(DecisionReason::kStickyReplicate), "sticky_replicate");
  EXPECT_STREQ(DecisionReasonName(DecisionReason::kPromoted), "promoted");
  EXPECT_STREQ(DecisionReasonName(DecisionReason::kUnspecified), "unspecified");
}

TEST(NamesTest, EnumValuesMatchTheWireApi) {
  // Values are sent as shardcoord.v1 enums; renumbering would break old peers.
  EXPECT_EQ(static_cast<int>(Policy::kAuto), 1);
  EXPECT_EQ(static_cast<int>(Policy::kPerLayer), 2);
  EXPECT_EQ(static_cast<int>(Policy::kRoot), 3);
  EXPECT_EQ(static_cast<int>(Policy::kReplicate), 4);
  EXPECT_EQ(static_cast<int>(Fallback::kRoot), 1);
  EXPECT_EQ(static_cast<int>(Fallback::kReplicate), 2);
  EXPECT_EQ(static_cast<int>(Decision::kPerLayer), 1);
  EXPECT_EQ(static_cast<int>(Decision::kSkip), 2);
  EXPECT_EQ(static_cast<int>(Decision::kRoot), 3);
  EXPECT_EQ(static_cast<int>(Decision::kReplicate), 4);
  EXPECT_EQ(static_cast<int>(Decision::kPadded), 5);
  EXPECT_EQ(static_cast<int>(Fallback::kPadded), 3);
  EXPECT_EQ(static_cast<int>(DecisionReason::kPromoted), 6);
}

// ---------------------------------------------------------------------------------------
// MicrobatchKey

TEST(MicrobatchKeyTest, OrderedByStepThenMicrobatch) {
  const MicrobatchKey a{1, 5}, b{2, 0}, c{2, 1}, c2{2, 1};
  EXPECT_TRUE(a < b);
  EXPECT_TRUE(b < c);
  EXPECT_FALSE(c < b);
  EXPECT_FALSE(c < c2);
  EXPECT_TRUE(c == c2);
  EXPECT_TRUE(b != c);
  EXPECT_TRUE(c <= c2);
  EXPECT_TRUE(a <= b);
  EXPECT_FALSE(b <= a);
  EXPECT_TRUE(c > a);
  EXPECT_FALSE(a > c);
}

TEST(MicrobatchKeyTest, ToStringAndStream) {
  EXPECT_EQ((MicrobatchKey{3, 1}.ToString()), "(3,1)");
  EXPECT_EQ((MicrobatchKey{0, 0}.ToString()), "(0,0)");
  EXPECT_EQ((MicrobatchKey{1234567890123, 42}.ToString()), "(1234567890123,42)");
  std::ostringstream os;
  os << MicrobatchKey{7, 2};
  EXPECT_EQ(os.str(), "(7,2)");
}

// ---------------------------------------------------------------------------------------
// MicrobatchDecision / DecisionDigest

MicrobatchDecision SampleDecision() {
  MicrobatchDecision d;
  d.group = 3;
  d.key = MicrobatchKey{17, 2};
  d.seq = 41;
  d.epoch = 1;
  d.modules = {
      {"model.vision_tower", Decision::kPerLayer, DecisionReason::kUniform},
      {"model.audio_tower", Decision::kRoot, DecisionReason::kDivergent},
      {"model.multi_modal_projector", Decision::kSkip, DecisionReason::kAllSkip},
  };
  return d;
}

TEST(DecisionDigestTest, DeterministicForEqualDecisions) {
  MicrobatchDecision a = SampleDecision();
  MicrobatchDecision b = SampleDecision();
  EXPECT_EQ(DecisionDigest(a), DecisionDigest(b));
  EXPECT_EQ(DecisionDigest(a), DecisionDigest(a));
  EXPECT_NE(DecisionDigest(a), 0u);
}

TEST(DecisionDigestTest, PinnedValueIsStableAcrossVersions) {
  // Computed once from SampleDecision(); ranks built from different versions compare
  // digests, so this value must never change.
  EXPECT_EQ(DecisionDigest(SampleDecision()), 0xade16a9dc483992eULL);
}

TEST(DecisionDigestTest, PinnedValueOfEmptyDecision) {
  // FNV-1a 64 over group, step, microbatch and seq, each as 8 zero bytes.
  EXPECT_EQ(DecisionDigest(MicrobatchDecision{}), 0x171bb79dc8e18503ULL);
}

TEST(DecisionDigestTest, DoesNotDependOnTheStoredDigestField) {
  MicrobatchDecision a = SampleDecision();
  MicrobatchDecision b = SampleDecision();
  b.digest = 0xdeadbeef;
  EXPECT_EQ(DecisionDigest(a), DecisionDigest(b));
}

TEST(DecisionDigestTest, ChangesWhenAnyIncludedFieldChanges) {
  const uint64_t base = DecisionDigest(SampleDecision());
  struct Mutation {
    const char* what;
    void (*apply)(MicrobatchDecision*);
  };
  const Mutation mutations[] = {
      {"group", [](MicrobatchDecision* d) { d->group = 4; }},
      {"step", [](MicrobatchDecision* d) { d->key.step = 18; }},
      {"microbatch", [](MicrobatchDecision* d) { d->key.microbatch = 3; }},
      {"seq", [](MicrobatchDecision* d) { d->seq = 42; }},
      {"module name", [](MicrobatchDecision* d) { d->modules[0].module = "model.visual"; }},
      {"decision", [](MicrobatchDecision* d) { d->modules[1].decision = Decision::kReplicate; }},
      {"reason", [](MicrobatchDecision* d) { d->modules[1].reason = DecisionReason::kPromoted; }},
      {"module order", [](MicrobatchDecision* d) { std::swap(d->modules[0], d->modules[2]); }},
      {"module dropped", [](MicrobatchDecision* d) { d->modules.pop_back(); }},
      {"padded", [](MicrobatchDecision* d) { d->modules[1] = {d->modules[1].module, Decision::kPadded, DecisionReason::kDivergent, 2}; }},
      {"step/microbatch swapped",
       [](MicrobatchDecision* d) { d->key = MicrobatchKey{2, 17}; }},
  };
  for (const Mutation& m : mutations) {
    MicrobatchDecision d = SampleDecision();
    m.apply(&d);
    EXPECT_NE(DecisionDigest(d), base) << "digest ignores a change of " << m.what;
  }
}

TEST(DecisionDigestTest, APaddedDecisionsPassesCountAndNoOtherDecisionsDo) {
  MicrobatchDecision d = SampleDecision();
  d.modules[1] = {d.modules[1].module, Decision::kPadded, DecisionReason::kDivergent, 2};
  MicrobatchDecision more = d;
  more.modules[1].calls = 3;  // A forged pass count would hang the group: the digest differs.
  EXPECT_NE(DecisionDigest(d), DecisionDigest(more));
  MicrobatchDecision pinned = SampleDecision();
  pinned.modules[0].calls = 7;  // Ignored for every other decision, so old digests stay.
  EXPECT_EQ(DecisionDigest(pinned), DecisionDigest(SampleDecision()));
}

TEST(DecisionDigestTest, ModuleNameBoundariesAreUnambiguous) {
  // Names are length-prefixed: moving a character from one name to the next changes it.
  MicrobatchDecision a;
  a.modules = {{"ab", Decision::kSkip, DecisionReason::kAllSkip},
               {"c", Decision::kSkip, DecisionReason::kAllSkip}};
  MicrobatchDecision b = a;
  b.modules[0].module = "a";
  b.modules[1].module = "bc";
  EXPECT_NE(DecisionDigest(a), DecisionDigest(b));
}

TEST(MicrobatchDecisionTest, FindReturnsModuleOrNull) {
  MicrobatchDecision d = SampleDecision();
  const ModuleDecision* m = d.Find("model.audio_tower");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->decision, Decision::kRoot);
  EXPECT_EQ(m->reason, DecisionReason::kDivergent);
  EXPECT_EQ(d.Find("model.audio"), nullptr);
  EXPECT_EQ(d.Find(""), nullptr);
}

}  // namespace

namespace {

TEST(PlanCheckTest, KeysAndCallsAreCheckedTheSameWayOnBothSides) {
  using shardcoord::CheckPlanCall;
  using shardcoord::CheckPlanKey;
  EXPECT_EQ(CheckPlanKey({0, 0}), "");
  EXPECT_EQ(CheckPlanKey({-1, 0}), "step and microbatch must be >= 0");
  EXPECT_EQ(CheckPlanKey({0, -2}), "step and microbatch must be >= 0");
  EXPECT_EQ(CheckPlanCall("visual", 2, true, {}), "");
  EXPECT_EQ(CheckPlanCall("visual", -3, true, {}), "module 'visual' has -3 calls; calls must be >= 0");
  EXPECT_EQ(CheckPlanCall("visual", kMaxCallsPerModule, true, {}), "");
  EXPECT_EQ(CheckPlanCall("visual", kMaxCallsPerModule + 1, true, {}),
            "module 'visual' has 4097 calls in one microbatch; at most 4096 are allowed (count the module's forward "
            "calls, not its inputs)");
  EXPECT_EQ(CheckPlanCall("vison", 1, false, {"visual", "audio_tower"}),
            "names unknown module 'vison'; the registered controlled modules are [visual, audio_tower]");
  std::vector<std::string> many;
  for (int i = 0; i < 20; ++i) many.push_back("m" + std::to_string(i));
  const std::string long_list = CheckPlanCall("x", 1, false, many);
  EXPECT_NE(long_list.find("m15, ... (4 more)]"), std::string::npos) << long_list;
  EXPECT_EQ(long_list.find("m16"), std::string::npos) << "at most 16 named";
}

TEST(PlanCheckTest, PrintableIsValidUtf8CutBetweenCharactersWithControlsEscaped) {
  using shardcoord::Printable;
  EXPECT_EQ(Printable("t\xc3\xa2" "che"), "t\xc3\xa2" "che");  // UTF-8 passes through.
  // A cut inside a two-byte character keeps the text valid UTF-8 (a cut at byte 256 of a
  // goodbye reason made every operator's query fail to parse).
  std::string reason(255, 'a');
  reason += "\xc3\xa9tait";
  EXPECT_EQ(Printable(reason), std::string(255, 'a') + "...");
  // C1 controls (U+009B is a terminal's CSI) and bidi overrides (U+202E) are shown, not passed.
  EXPECT_EQ(Printable("a\xc2\x9b" "2Jb"), "a\\xc2\\x9b2Jb");
  EXPECT_EQ(Printable("evil\xe2\x80\xaetxt.exe"), "evil\\xe2\\x80\\xaetxt.exe");
  EXPECT_EQ(Printable("a\nb\x7f"), "a\\x0ab\\x7f");
  // Invalid sequences are escaped byte by byte: a stray continuation, a truncated lead, an
  // overlong slash, a surrogate.
  EXPECT_EQ(Printable("\x80x\xe2\x82"), "\\x80x\\xe2\\x82");
  EXPECT_EQ(Printable("\xc0\xaf"), "\\xc0\\xaf");
  EXPECT_EQ(Printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");
}

}  // namespace
