// Unit tests of the decoder tokens `shardctl plan` prices: a trace line's optional "tokens"
// (client/trace.h) and a cost file's optional "other_seconds_per_token" and
// "other_tokens_per_microbatch" (client/cost_model.h), each bad value refused with an error that
// names the file, the line or the field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "cost_model.h"
#include "trace.h"

namespace {

using namespace shardcoord;
using shardcoord::client::CostFile;
using shardcoord::client::kMaxTraceTokens;
using shardcoord::client::ParseCostFile;
using shardcoord::client::ParseTrace;
using shardcoord::client::Trace;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;
using ::testing::StartsWith;

absl::StatusOr<Trace> Parse(const std::string& text) {
  std::istringstream in(text);
  return ParseTrace(in, "t.jsonl");
}

TEST(TraceTokensTest, EveryLinesTokensAreKeptPerRankAndMicrobatch) {
  absl::StatusOr<Trace> t = Parse(
      R"({"rank":0,"step":0,"microbatch":0,"calls":{"visual":1},"tokens":12288})" "\n"
      "\n"
      R"({"rank":1,"step":0,"microbatch":0,"tokens":0})" "\n"
      R"({"rank":0,"step":1,"microbatch":0,"calls":{"visual":2},"tokens":2147483647})" "\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->has_tokens());
  EXPECT_THAT(t->tokens.at(0), ElementsAre(Pair(MicrobatchKey{0, 0}, 12288), Pair(MicrobatchKey{1, 0}, kMaxTraceTokens)));
  EXPECT_THAT(t->tokens.at(1), ElementsAre(Pair(MicrobatchKey{0, 0}, 0)));
  // The calls are read as before.
  EXPECT_THAT(t->plans.at(0).at(MicrobatchKey{1, 0}), ElementsAre(Pair("visual", 2)));
  EXPECT_THAT(t->plans.at(1).at(MicrobatchKey{0, 0}), IsEmpty());
}

TEST(TraceTokensTest, ATraceWithoutTokensHasNone) {
  absl::StatusOr<Trace> t = Parse(
      R"({"rank":0,"step":0,"microbatch":0,"calls":{"visual":1}})" "\n"
      R"({"rank":1,"step":0,"microbatch":0})" "\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->has_tokens());
  EXPECT_THAT(t->tokens, IsEmpty());
  EXPECT_EQ(t->plans.size(), 2u);
}

void ExpectTraceError(const std::string& text, const std::string& where, const std::string& fact) {
  absl::StatusOr<Trace> t = Parse(text);
  ASSERT_FALSE(t.ok()) << "accepted:\n" << text;
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), StartsWith(where));
  EXPECT_THAT(t.status().message(), HasSubstr(fact));
}

constexpr char kFirst[] = R"({"rank":0,"step":0,"microbatch":0,"tokens":100})" "\n";
constexpr char kMustBe[] = "'tokens' must be a non-negative integer (the decoder tokens of the rank's microbatch, "
                           "at most 2147483647), got ";

TEST(TraceTokensErrorTest, NegativeTokens) {
  ExpectTraceError(std::string(kFirst) + R"({"rank":1,"step":0,"microbatch":0,"tokens":-1})" "\n", "t.jsonl:2: ",
                   std::string(kMustBe) + "-1");
}

TEST(TraceTokensErrorTest, NonIntegerTokens) {
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"tokens":1.5})" "\n", "t.jsonl:1: ", std::string(kMustBe) + "1.5");
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"tokens":"12"})" "\n", "t.jsonl:1: ",
                   std::string(kMustBe) + "\"12\"");
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"tokens":null})" "\n", "t.jsonl:1: ",
                   std::string(kMustBe) + "null");
}

TEST(TraceTokensErrorTest, HugeTokens) {
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"tokens":2147483648})" "\n", "t.jsonl:1: ",
                   std::string(kMustBe) + "2147483648");
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"tokens":18446744073709551615})" "\n", "t.jsonl:1: ",
                   std::string(kMustBe) + "18446744073709551615");
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"tokens":1e300})" "\n", "t.jsonl:1: ", kMustBe);
  // A long value is cut short in the message: its first 37 characters and "...".
  ExpectTraceError(absl::StrCat(R"({"rank":0,"step":0,"microbatch":0,"tokens":")", std::string(60, 'x'), "\"}\n"),
                   "t.jsonl:1: ", absl::StrCat(kMustBe, "\"", std::string(36, 'x'), "..."));
}

TEST(TraceTokensErrorTest, EveryLineOrNone) {
  // The first non-blank line decides; the first line that differs is named, with that line.
  ExpectTraceError(std::string("\n") + R"({"rank":0,"step":0,"microbatch":0})" "\n" +
                       R"({"rank":1,"step":0,"microbatch":0,"tokens":5})" "\n",
                   "t.jsonl:3: ", "'tokens' is given, but line 2 has none: give every line its microbatch's tokens, or none");
  ExpectTraceError(std::string(kFirst) + R"({"rank":0,"step":0,"microbatch":1,"tokens":5})" "\n" +
                       R"({"rank":1,"step":0,"microbatch":0,"calls":{"visual":1}})" "\n",
                   "t.jsonl:3: ", "'tokens' is missing, but line 1 gives it");
}

TEST(TraceTokensErrorTest, AnUnknownFieldListsTokensAmongTheFields) {
  ExpectTraceError(R"({"rank":0,"step":0,"microbatch":0,"token":5})" "\n", "t.jsonl:1: ",
                   "unknown field 'token' (fields: rank, step, microbatch, calls, tokens)");
}

// ---------------------------------------------------------------------------------------
// The cost file's token price.

std::string Cost(const std::string& extra) {
  return absl::StrCat(R"({"format":"shardcoord.cost/v1","other_seconds_per_microbatch":0.28)", extra,
                      R"(,"modules":[{"name":"visual","forward_seconds_per_call":0.01,"units":[]}]})");
}

TEST(CostTokenPriceTest, BothFieldsAreRead) {
  absl::StatusOr<CostFile> f =
      ParseCostFile(Cost(R"(,"other_seconds_per_token":4.66e-05,"other_tokens_per_microbatch":8192)"), "c.json");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(f->other_seconds_per_token.has_value());
  EXPECT_DOUBLE_EQ(*f->other_seconds_per_token, 4.66e-05);
  EXPECT_EQ(f->other_tokens_per_microbatch, 8192);
  EXPECT_THAT(f->warnings, IsEmpty());
}

TEST(CostTokenPriceTest, WithoutThemThereIsNoPrice) {
  absl::StatusOr<CostFile> f = ParseCostFile(Cost(""), "c.json");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->other_seconds_per_token.has_value());
  EXPECT_EQ(f->other_tokens_per_microbatch, 0);
  // A price of 0 is a price (the reference tokens default to 0).
  f = ParseCostFile(Cost(R"(,"other_seconds_per_token":0)"), "c.json");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->other_seconds_per_token, 0.0);
  EXPECT_EQ(f->other_tokens_per_microbatch, 0);
}

TEST(CostTokenPriceTest, TheTokensWithoutThePriceAreIgnoredWithAWarning) {
  absl::StatusOr<CostFile> f = ParseCostFile(Cost(R"(,"other_tokens_per_microbatch":8192)"), "c.json");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->other_seconds_per_token.has_value());
  EXPECT_THAT(f->warnings, ElementsAre("c.json: 'other_tokens_per_microbatch' without 'other_seconds_per_token' is "
                                       "ignored (give both to price a trace's tokens)"));
}

TEST(CostTokenPriceTest, BadValuesNameTheField) {
  const std::pair<std::string, std::string> cases[] = {
      {R"(,"other_seconds_per_token":-1e-05)", "c.json: 'other_seconds_per_token' must be a number of seconds "
                                               "from 0 to 86400, got -1e-05"},
      {R"(,"other_seconds_per_token":"fast")", "'other_seconds_per_token' must be a number of seconds from 0 to 86400, "
                                               "got \"fast\""},
      {R"(,"other_seconds_per_token":1,"other_tokens_per_microbatch":-5)",
       "c.json: 'other_tokens_per_microbatch' must be an integer in 0..2147483647, got -5"},
      {R"(,"other_seconds_per_token":1,"other_tokens_per_microbatch":81.5)",
       "'other_tokens_per_microbatch' must be an integer in 0..2147483647, got 81.5"},
      {R"(,"other_seconds_per_token":1,"other_tokens_per_microbatch":2147483648)",
       "'other_tokens_per_microbatch' must be an integer in 0..2147483647, got 2147483648"},
  };
  for (const auto& [extra, error] : cases) {
    absl::StatusOr<CostFile> f = ParseCostFile(Cost(extra), "c.json");
    ASSERT_FALSE(f.ok()) << extra;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(f.status().message(), HasSubstr(error)) << extra;
  }
}

}  // namespace
