// Unit tests of `shardctl plan`'s cost model files (client/cost_model.h): a good file, and
// for each bad field an error that names the file and the field.
#include "cost_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using namespace shardcoord;
using shardcoord::client::CostFile;
using shardcoord::client::CostModelsFor;
using shardcoord::client::ParseCostFile;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;
using ::testing::StartsWith;

constexpr char kGood[] = R"({
  "format": "shardcoord.cost/v1",
  "measured": {"machine": "1 x H200", "date": "2026-12-03", "anything": [1, 2]},
  "group_size": 2,
  "other_seconds_per_microbatch": 0.081,
  "modules": [
    {"name": "visual", "param_bytes": 1234, "forward_seconds_per_call": 0.0123,
     "units": [{"name": "blocks.0", "param_bytes": 456, "gather_bytes": 400, "gather_seconds": 0.00031},
               {"name": "blocks.1", "param_bytes": 778, "gather_seconds": 0.0005}]},
    {"name": "audio_tower", "forward_seconds_per_call": 0, "units": []}
  ]
})";

std::vector<ModuleSpec> Manifest() {
  return {{"visual", 1234, {{"blocks.0", 456}, {"blocks.1", 778}}, false}, {"audio_tower", 100, {}, false}};
}

TEST(ParseCostFileTest, AGoodFileGivesEveryField) {
  absl::StatusOr<CostFile> f = ParseCostFile(kGood, "cost.json");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->group_size, 2);
  EXPECT_DOUBLE_EQ(f->other_seconds_per_microbatch, 0.081);
  ASSERT_THAT(f->modules, SizeIs(2));
  const ModuleCost& visual = f->modules[0].cost;
  EXPECT_EQ(visual.module, "visual");
  EXPECT_EQ(f->modules[0].param_bytes, 1234);
  EXPECT_DOUBLE_EQ(visual.forward_seconds_per_call, 0.0123);
  ASSERT_THAT(visual.units, SizeIs(2));
  EXPECT_EQ(visual.units[0].unit, "blocks.0");
  EXPECT_EQ(visual.units[0].gather_bytes, 400);
  EXPECT_EQ(visual.units[1].gather_bytes, 778) << "gather_bytes defaults to the unit's param_bytes";
  EXPECT_DOUBLE_EQ(visual.GatherSeconds(), 0.00081);
  EXPECT_FALSE(f->modules[1].param_bytes.has_value());
  EXPECT_THAT(f->modules[1].cost.units, IsEmpty());
  EXPECT_THAT(f->warnings, IsEmpty());
}

TEST(ParseCostFileTest, TheRestUnitIsNamedByTheEmptyString) {
  // The probe: a cost file refused the rest unit's name "", as the manifest and the daemon name it.
  absl::StatusOr<CostFile> f = ParseCostFile(R"({"format": "shardcoord.cost/v1", "group_size": 2, "other_seconds_per_microbatch": 0, "modules": [
    {"name": "visual", "forward_seconds_per_call": 0.01,
     "units": [{"name": "", "param_bytes": 900, "gather_seconds": 0.002},
               {"name": "blocks.0", "param_bytes": 100, "gather_seconds": 0.0003}]}]})", "c.json");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_THAT(f->modules[0].cost.units, SizeIs(2));
  EXPECT_EQ(f->modules[0].cost.units[0].unit, "");
  EXPECT_EQ(f->modules[0].cost.units[0].gather_bytes, 900);
}

TEST(ParseCostFileTest, OptionalFieldsMayBeLeftOutAndUnknownOnesAreNamedInWarnings) {
  absl::StatusOr<CostFile> f = ParseCostFile(
      R"({"format": "shardcoord.cost/v1", "other_seconds_per_microbatch": 0, "note": "x",
          "modules": [{"name": "visual", "forward_seconds_per_call": 1, "units": [],
                       "forward_seconds_per_cal": 2}]})",
      "c.json");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->group_size, 0);
  EXPECT_THAT(f->warnings,
              ElementsAre(AllOf(StartsWith("c.json: modules[0] ('visual'): unknown field 'forward_seconds_per_cal'"),
                                HasSubstr("forward_seconds_per_call")),
                          StartsWith("c.json: unknown field 'note' ignored")));
}

TEST(ParseCostFileTest, EachBadFieldGivesAnErrorNamingTheFileAndTheField) {
  const std::string head = R"("format": "shardcoord.cost/v1", "other_seconds_per_microbatch": 0.1)";
  auto with_module = [&](const std::string& module) { return "{" + head + R"(, "modules": [)" + module + "]}"; };
  auto with_unit = [&](const std::string& unit) {
    return with_module(R"({"name": "visual", "forward_seconds_per_call": 0.01, "units": [)" + unit + "]}");
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "c.json: not valid JSON"},
      {"[1]", "c.json: must be a JSON object"},
      {R"({"other_seconds_per_microbatch": 0.1, "modules": []})", "c.json: 'format' is missing"},
      {R"({"format": "shardcoord.cost/v0", "other_seconds_per_microbatch": 0.1, "modules": []})",
       "c.json: 'format' is \"shardcoord.cost/v0\", expected \"shardcoord.cost/v1\""},
      {"{" + head + R"(, "measured": 3, "modules": []})", "c.json: 'measured' must be an object"},
      {"{" + head + R"(, "group_size": 0, "modules": []})", "c.json: 'group_size' must be an integer in 1.."},
      {"{" + head + R"(, "group_size": "2", "modules": []})", "c.json: 'group_size' must be an integer in 1.."},
      {R"({"format": "shardcoord.cost/v1", "modules": []})", "c.json: 'other_seconds_per_microbatch' is missing"},
      {R"({"format": "shardcoord.cost/v1", "other_seconds_per_microbatch": -0.5, "modules": []})",
       "c.json: 'other_seconds_per_microbatch' must be a number of seconds from 0 to 86400, got -0.5"},
      {"{" + head + "}", "c.json: 'modules' is missing"},
      {"{" + head + R"(, "modules": {}})", "c.json: 'modules' must be a list"},
      {with_module("7"), "c.json: modules[0]: must be an object, got 7"},
      {with_module(R"({"forward_seconds_per_call": 1, "units": []})"), "c.json: modules[0]: 'name' is missing"},
      {with_module(R"({"name": "", "forward_seconds_per_call": 1, "units": []})"),
       "c.json: modules[0]: 'name' must be a non-empty string"},
      {with_module(R"({"name": "visual", "units": []})"),
       "c.json: modules[0] ('visual'): 'forward_seconds_per_call' is missing"},
      {with_module(R"({"name": "visual", "forward_seconds_per_call": -1, "units": []})"),
       "c.json: modules[0] ('visual'): 'forward_seconds_per_call' must be a number of seconds from 0 to 86400, got -1"},
      {with_module(R"({"name": "visual", "forward_seconds_per_call": 1e308, "units": []})"),
       "c.json: modules[0] ('visual'): 'forward_seconds_per_call' must be a number of seconds from 0 to 86400, got 1e+308"},
      {with_module(R"({"name": "visual", "forward_seconds_per_call": "fast", "units": []})"),
       "c.json: modules[0] ('visual'): 'forward_seconds_per_call' must be a number of seconds from 0 to 86400, got \"fast\""},
      {with_module(R"({"name": "visual", "forward_seconds_per_call": 1, "param_bytes": -2, "units": []})"),
       "c.json: modules[0] ('visual'): 'param_bytes' must be an integer in 0.."},
      {with_module(R"({"name": "visual", "forward_seconds_per_call": 1, "param_bytes": 1.5, "units": []})"),
       "c.json: modules[0] ('visual'): 'param_bytes' must be an integer in 0.."},
      {with_module(R"({"name": "visual", "forward_seconds_per_call": 1})"),
       "c.json: modules[0] ('visual'): 'units' is missing"},
      {with_module(R"({"name": "visual", "forward_seconds_per_call": 1, "units": 3})"),
       "c.json: modules[0] ('visual'): 'units' must be a list"},
      {with_unit(R"({"gather_seconds": 1})"), "c.json: modules[0] ('visual').units[0]: 'name' is missing"},
      {with_unit(R"({"name": "blocks.0"})"),
       "c.json: modules[0] ('visual').units[0] ('blocks.0'): 'gather_seconds' is missing"},
      {with_unit(R"({"name": "blocks.0", "gather_seconds": -0.001})"),
       "c.json: modules[0] ('visual').units[0] ('blocks.0'): 'gather_seconds' must be a number of seconds from 0 to 86400"},
      {with_unit(R"({"name": "blocks.0", "gather_seconds": 0.001, "gather_bytes": -1})"),
       "c.json: modules[0] ('visual').units[0] ('blocks.0'): 'gather_bytes' must be an integer in 0.."},
      {with_unit(R"({"name": "b", "gather_seconds": 0}, {"name": "b", "gather_seconds": 0})"),
       "c.json: modules[0] ('visual').units[1]: unit 'b' appears twice"},
      {with_module(R"({"name": "v", "forward_seconds_per_call": 1, "units": []},
                      {"name": "v", "forward_seconds_per_call": 1, "units": []})"),
       "c.json: modules[1]: module 'v' appears twice"},
  };
  // Each error: the start of the message, file and field included.
  for (const auto& [json, error] : cases) {
    absl::StatusOr<CostFile> f = ParseCostFile(json, "c.json");
    ASSERT_FALSE(f.ok()) << json;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_THAT(std::string(f.status().message()), StartsWith(error)) << json;
  }
}

TEST(CostModelsForTest, GivesEachManifestModuleItsCostInManifestOrder) {
  absl::StatusOr<CostFile> f = ParseCostFile(kGood, "cost.json");
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<ModuleSpec> manifest = Manifest();
  std::swap(manifest[0], manifest[1]);
  std::vector<std::string> warnings;
  auto models = CostModelsFor(*f, manifest, "cost.json", &warnings);
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_THAT(*models, SizeIs(2));
  EXPECT_FALSE((*models)[0].Known()) << "audio_tower: forward 0, no units";
  EXPECT_DOUBLE_EQ((*models)[1].forward_seconds_per_call, 0.0123);
  EXPECT_DOUBLE_EQ((*models)[1].gather_seconds, 0.00081);
  EXPECT_THAT(warnings, IsEmpty());
}

TEST(CostModelsForTest, AModuleTheManifestLacksIsAnErrorNamingTheManifestsModules) {
  absl::StatusOr<CostFile> f = ParseCostFile(kGood, "cost.json");
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<std::string> warnings;
  auto models = CostModelsFor(*f, {Manifest()[0]}, "cost.json", &warnings);
  ASSERT_FALSE(models.ok());
  EXPECT_EQ(models.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(models.status().message(), "cost.json: module 'audio_tower' is not in the manifest [visual]");
}

TEST(CostModelsForTest, AManifestModuleWithoutCostsCostsNothingWithAWarning) {
  absl::StatusOr<CostFile> f = ParseCostFile(
      R"({"format": "shardcoord.cost/v1", "other_seconds_per_microbatch": 0.1,
          "modules": [{"name": "visual", "param_bytes": 99, "forward_seconds_per_call": 0.5, "units": []}]})",
      "c.json");
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<std::string> warnings;
  auto models = CostModelsFor(*f, Manifest(), "c.json", &warnings);
  ASSERT_TRUE(models.ok()) << models.status();
  EXPECT_DOUBLE_EQ((*models)[0].forward_seconds_per_call, 0.5);
  EXPECT_DOUBLE_EQ((*models)[1].forward_seconds_per_call, 0);
  EXPECT_DOUBLE_EQ((*models)[1].gather_seconds, 0);
  EXPECT_THAT(warnings,
              ElementsAre("c.json: module 'visual' has param_bytes 99, the manifest 1234; the manifest's are used",
                          "c.json: no costs for module 'audio_tower' of the manifest; it is taken to cost nothing"));
}

}  // namespace
