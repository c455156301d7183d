// Unit tests of the replay input formats (client/trace.h): JSON-lines traces and module
// manifests, including the precise "source:LINE:" error messages.
#include "trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace {

using namespace shardcoord;
using shardcoord::client::ParseManifest;
using shardcoord::client::ParseTrace;
using shardcoord::client::Trace;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;
using ::testing::StartsWith;

absl::StatusOr<Trace> Parse(const std::string& text, const std::string& source = "t.jsonl") {
  std::istringstream in(text);
  return ParseTrace(in, source);
}

// ---------------------------------------------------------------------------------------
// ParseTrace: valid input

TEST(ParseTraceTest, ValidMultiLineTrace) {
  const std::string text =
      R"({"rank":0,"step":0,"microbatch":0,"calls":{"vision_tower":1,"audio_tower":0}})" "\n"
      R"({"rank":1,"step":0,"microbatch":0,"calls":{"vision_tower":0}})" "\n"
      "\n"
      "   \t\n"
      R"({"rank":0,"step":0,"microbatch":1,"calls":{"mm_projector":2}})" "\n"
      R"({"rank":3,"step":1,"microbatch":0})" "\n";
  absl::StatusOr<Trace> t = Parse(text);
  ASSERT_TRUE(t.ok()) << t.status();

  EXPECT_THAT(t->keys, ElementsAre(MicrobatchKey{0, 0}, MicrobatchKey{0, 1}, MicrobatchKey{1, 0}));
  EXPECT_THAT(t->module_names, ElementsAre("audio_tower", "mm_projector", "vision_tower"));
  EXPECT_EQ(t->max_rank, 3);

  ASSERT_EQ(t->plans.size(), 3u);  // Ranks 0, 1 and 3; rank 2 never appears.
  EXPECT_EQ(t->plans.count(2), 0u);
  const auto& r0 = t->plans.at(0);
  ASSERT_EQ(r0.size(), 2u);
  EXPECT_THAT(r0.at(MicrobatchKey{0, 0}), ElementsAre(Pair("audio_tower", 0), Pair("vision_tower", 1)));
  EXPECT_THAT(r0.at(MicrobatchKey{0, 1}), ElementsAre(Pair("mm_projector", 2)));
  EXPECT_THAT(t->plans.at(1).at(MicrobatchKey{0, 0}), ElementsAre(Pair("vision_tower", 0)));

  // No "calls" field: the rank runs no controlled module in that microbatch.
  const auto& r3 = t->plans.at(3);
  ASSERT_EQ(r3.count(MicrobatchKey{1, 0}), 1u);
  EXPECT_THAT(r3.at(MicrobatchKey{1, 0}), IsEmpty());
}

TEST(ParseTraceTest, KeysAreSortedWhateverTheLineOrder) {
  const std::string text =
      R"({"rank":0,"step":2,"microbatch":1})" "\n"
      R"({"rank":0,"step":0,"microbatch":3})" "\n"
      R"({"rank":1,"step":2,"microbatch":0})" "\n";
  absl::StatusOr<Trace> t = Parse(text);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(t->keys, ElementsAre(MicrobatchKey{0, 3}, MicrobatchKey{2, 0}, MicrobatchKey{2, 1}));
  EXPECT_THAT(t->module_names, IsEmpty());
  EXPECT_EQ(t->max_rank, 1);
}

TEST(ParseTraceTest, SameKeyOnDifferentRanksIsFine) {
  absl::StatusOr<Trace> t = Parse(
      R"({"rank":0,"step":0,"microbatch":0,"calls":{"visual":1}})" "\n"
      R"({"rank":1,"step":0,"microbatch":0,"calls":{"visual":1}})" "\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->keys.size(), 1u);
  EXPECT_EQ(t->plans.size(), 2u);
}

TEST(ParseTraceTest, LastLineWithoutNewlineAndCrLf) {
  absl::StatusOr<Trace> t = Parse(
      "{\"rank\":0,\"step\":0,\"microbatch\":0}\r\n"
      "{\"rank\":0,\"step\":0,\"microbatch\":1}");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->keys.size(), 2u);
}

// ---------------------------------------------------------------------------------------
// ParseTrace: errors name the source and the line

void ExpectTraceError(const std::string& text, const std::string& where,
                      const std::string& fact) {
  absl::StatusOr<Trace> t = Parse(text);
  ASSERT_FALSE(t.ok()) << "accepted:\n" << text;
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), StartsWith(where));
  EXPECT_THAT(t.status().message(), HasSubstr(fact));
}

const char kGoodLine[] = R"({"rank":0,"step":0,"microbatch":0})" "\n";

TEST(ParseTraceErrorTest, InvalidJson) {
  ExpectTraceError(std::string(kGoodLine) + "{\"rank\":0,\n", "t.jsonl:2:", "not valid JSON");
}

TEST(ParseTraceErrorTest, LineNumbersCountBlankLines) {
  ExpectTraceError(std::string(kGoodLine) + "\n\nnot json\n", "t.jsonl:4:", "not valid JSON");
}

TEST(ParseTraceErrorTest, UsesTheGivenSourceName) {
  std::istringstream in("[1,2]\n");
  absl::StatusOr<Trace> t = ParseTrace(in, "/data/run7.jsonl");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), StartsWith("/data/run7.jsonl:1:"));
  EXPECT_THAT(t.status().message(), HasSubstr("JSON object"));
}

TEST(ParseTraceErrorTest, MissingRank) {
  ExpectTraceError(std::string(kGoodLine) + R"({"step":0,"microbatch":1})" "\n", "t.jsonl:2:",
                   "'rank'");
}

TEST(ParseTraceErrorTest, MissingMicrobatch) {
  ExpectTraceError(R"({"rank":0,"step":0})" "\n", "t.jsonl:1:", "'microbatch'");
}

TEST(ParseTraceErrorTest, NegativeStep) {
  ExpectTraceError(std::string(kGoodLine) + R"({"rank":0,"step":-1,"microbatch":1})" "\n",
                   "t.jsonl:2:", "'step' must be a non-negative integer");
}

TEST(ParseTraceErrorTest, NonIntegerRank) {
  ExpectTraceError(R"({"rank":"0","step":0,"microbatch":0})" "\n", "t.jsonl:1:", "'rank'");
  ExpectTraceError(R"({"rank":0.5,"step":0,"microbatch":0})" "\n", "t.jsonl:1:", "'rank'");
}

TEST(ParseTraceErrorTest, NonIntegerCalls) {
  ExpectTraceError(
      std::string(kGoodLine) +
          R"({"rank":1,"step":0,"microbatch":0,"calls":{"vision_tower":"one"}})" "\n",
      "t.jsonl:2:", "calls of module 'vision_tower'");
  ExpectTraceError(R"({"rank":1,"step":0,"microbatch":0,"calls":{"visual":1.5}})" "\n",
                   "t.jsonl:1:", "'visual'");
}

TEST(ParseTraceErrorTest, NegativeCalls) {
  ExpectTraceError(R"({"rank":1,"step":0,"microbatch":0,"calls":{"visual":-1}})" "\n",
                   "t.jsonl:1:", "calls of module 'visual' must be a non-negative integer");
}

TEST(ParseTraceErrorTest, RankOutOfIntRangeIsRejectedNotWrapped) {
  ExpectTraceError(R"({"rank":4294967296,"step":0,"microbatch":0})" "\n", "t.jsonl:1:",
                   "'rank'");
}

TEST(ParseTraceErrorTest, MicrobatchOutOfInt32RangeIsRejectedNotWrapped) {
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":4294967297})" "\n", "t.jsonl:1:",
                   "'microbatch'");
}

TEST(ParseTraceErrorTest, CallsOutOfInt32RangeAreRejectedNotWrapped) {
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"calls":{"visual":4294967297}})" "\n",
                   "t.jsonl:1:", "calls of module 'visual'");
}

TEST(ParseTraceErrorTest, CallsNotAnObject) {
  ExpectTraceError(R"({"rank":1,"step":0,"microbatch":0,"calls":[1,0]})" "\n", "t.jsonl:1:",
                   "'calls' must be an object");
}

TEST(ParseTraceErrorTest, UnknownField) {
  ExpectTraceError(
      std::string(kGoodLine) + R"({"rank":0,"step":0,"microbatch":1,"cals":{}})" "\n",
      "t.jsonl:2:", "unknown field 'cals'");
}

TEST(ParseTraceErrorTest, DuplicateRankAndKey) {
  ExpectTraceError(
      std::string(kGoodLine) + R"({"rank":1,"step":0,"microbatch":0})" "\n" + kGoodLine,
      "t.jsonl:3:", "rank 0 microbatch (0,0) appears twice");
}

TEST(ParseTraceErrorTest, EmptyTrace) {
  for (const std::string text : {"", "\n\n", "  \n\t\n"}) {
    absl::StatusOr<Trace> t = Parse(text);
    ASSERT_FALSE(t.ok()) << "accepted an empty trace: '" << text << "'";
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(t.status().message()), StartsWith("t.jsonl:"));
    EXPECT_THAT(t.status().message(), HasSubstr("no microbatch"));
  }
}

// ---------------------------------------------------------------------------------------
// ParseManifest

TEST(ParseManifestTest, ValidWithUnitsAndOutsideInnerRoot) {
  const std::string text = R"({"modules":[
    {"name":"vision_tower","param_bytes":1024,
     "units":[{"name":"layers.0","param_bytes":512},{"name":"layers.1","param_bytes":512}],
     "outside_inner_root":true,"trainable":true},
    {"name":"audio_tower"}
  ]})";
  absl::StatusOr<std::vector<ModuleSpec>> m = ParseManifest(text, "m.json");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 2u);

  const ModuleSpec& v = (*m)[0];
  EXPECT_EQ(v.name, "vision_tower");
  EXPECT_EQ(v.param_bytes, 1024);
  EXPECT_TRUE(v.outside_inner_root);
  EXPECT_TRUE(v.trainable);
  ASSERT_EQ(v.units.size(), 2u);
  EXPECT_EQ(v.units[0].name, "layers.0");
  EXPECT_EQ(v.units[0].param_bytes, 512);
  EXPECT_EQ(v.units[1].name, "layers.1");
  EXPECT_EQ(v.units[1].param_bytes, 512);

  // Optional fields default.
  const ModuleSpec& a = (*m)[1];
  EXPECT_EQ(a.name, "audio_tower");
  EXPECT_EQ(a.param_bytes, 0);
  EXPECT_FALSE(a.outside_inner_root);
  EXPECT_FALSE(a.trainable);
  EXPECT_THAT(a.units, IsEmpty());
}

TEST(ParseManifestTest, EmptyModuleListIsValid) {
  absl::StatusOr<std::vector<ModuleSpec>> m = ParseManifest(R"({"modules":[]})", "m.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(*m, IsEmpty());
}

TEST(ParseManifestTest, MissingModulesArray) {
  for (const std::string text : {R"({})", R"({"module":[]})", R"({"modules":{}})", R"([])"}) {
    absl::StatusOr<std::vector<ModuleSpec>> m = ParseManifest(text, "m.json");
    ASSERT_FALSE(m.ok()) << "accepted " << text;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(m.status().message()), StartsWith("m.json:"));
    EXPECT_THAT(m.status().message(), HasSubstr("\"modules\""));
  }
}

TEST(ParseManifestTest, MissingName) {
  absl::StatusOr<std::vector<ModuleSpec>> m =
      ParseManifest(R"({"modules":[{"name":"visual"},{"param_bytes":4}]})", "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("m.json: modules[1]"));
  EXPECT_THAT(m.status().message(), HasSubstr("'name'"));
}

TEST(ParseManifestTest, NonStringName) {
  absl::StatusOr<std::vector<ModuleSpec>> m =
      ParseManifest(R"({"modules":[{"name":7}]})", "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("modules[0]"));
}

TEST(ParseManifestTest, InvalidJson) {
  absl::StatusOr<std::vector<ModuleSpec>> m = ParseManifest("{\"modules\": [", "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), StartsWith("m.json:"));
  EXPECT_THAT(m.status().message(), HasSubstr("not valid JSON"));
}

TEST(ParseManifestTest, BadFieldTypeNamesTheModule) {
  absl::StatusOr<std::vector<ModuleSpec>> m =
      ParseManifest(R"({"modules":[{"name":"visual","param_bytes":"big"}]})", "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("modules[0]"));
  EXPECT_THAT(m.status().message(), HasSubstr("'visual'"));
}

// Byte counts: a number the JSON library holds as a double (past int64, or with a fraction) or
// a negative one is refused naming the module and unit, never cast (the fuzzer found the cast).
TEST(ParseManifestTest, ParamBytesOutOfRangeOrNotWholeIsRejectedNotCast) {
  for (const std::string bytes : {"2563333333333333333333333333333", "18446744073709551615", "-1", "1.5", "1e30"}) {
    SCOPED_TRACE(bytes);
    absl::StatusOr<std::vector<ModuleSpec>> m =
        ParseManifest(absl::StrCat(R"({"modules":[{"name":"visual","param_bytes":)", bytes, "}]}"), "m.json");
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(m.status().message(), HasSubstr("m.json: modules[0] ('visual'): 'param_bytes' must be a non-negative "
                                                "integer"));
    m = ParseManifest(absl::StrCat(R"({"modules":[{"name":"visual","units":[{"name":"blocks.0","param_bytes":)", bytes,
                                   "}]}]}"),
                      "m.json");
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m.status().message(), HasSubstr("('visual'), unit 'blocks.0': 'param_bytes'"));
  }
  absl::StatusOr<std::vector<ModuleSpec>> m =
      ParseManifest(R"({"modules":[{"name":"visual","param_bytes":9223372036854775807}]})", "m.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)[0].param_bytes, INT64_MAX);
}

TEST(ParseManifestTest, UnitWithoutNameIsAnError) {
  absl::StatusOr<std::vector<ModuleSpec>> m = ParseManifest(
      R"({"modules":[{"name":"visual","units":[{"param_bytes":4}]}]})", "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("'visual'"));
}

}  // namespace
