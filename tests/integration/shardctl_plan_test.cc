// `shardctl plan`, the real binary, on small traces, manifests and cost files written here,
// against numbers worked out by hand from the model of shardcoord/cost.h:
//
//   module visual: 1000 bytes in units of 400 and 600; forward F = 0.01 s per call, gather
//   G = 0.002 + 0.003 = 0.005 s; 0.1 s per microbatch outside it; groups of 2 ranks.
//   skip 0; per_layer c(G + F); root G + cF; replicate cF (resident) or G + cF (built).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "support/subprocess.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::RunCommand;
using testing::TempDir;

constexpr absl::Duration kCommandTimeout = absl::Seconds(60);
constexpr double kEps = 1e-9;

constexpr char kManifest[] = R"({"modules":[{"name":"visual","param_bytes":1000,
  "units":[{"name":"blocks.0","param_bytes":400},{"name":"blocks.1","param_bytes":600}]}]})";
constexpr char kCost[] = R"({"format":"shardcoord.cost/v1","measured":{"by":"hand"},"group_size":2,
  "other_seconds_per_microbatch":0.1,
  "modules":[{"name":"visual","param_bytes":1000,"forward_seconds_per_call":0.01,
    "units":[{"name":"blocks.0","param_bytes":400,"gather_seconds":0.002},
             {"name":"blocks.1","param_bytes":600,"gather_seconds":0.003}]}]})";

// Ranks 0 and 1: (0,0) both call twice; (0,1) rank 0 once, rank 1 not (divergent); (1,0)
// nobody (rank 1 has no line at all).
constexpr char kTrace[] = R"({"rank":0,"step":0,"microbatch":0,"calls":{"visual":2}}
{"rank":1,"step":0,"microbatch":0,"calls":{"visual":2}}
{"rank":0,"step":0,"microbatch":1,"calls":{"visual":1}}
{"rank":1,"step":0,"microbatch":1,"calls":{"visual":0}}
{"rank":0,"step":1,"microbatch":0,"calls":{"visual":0}}
)";

std::string Write(const TempDir& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir.File(name)) << text;
  return dir.File(name);
}

struct Plan {
  testing::RunResult run;
  std::map<std::string, nlohmann::json> by_policy;  // --json output.
};

// Runs `shardctl plan TRACE --manifest M --cost C --json EXTRA...`.
Plan RunPlanJson(const std::string& trace, const std::string& manifest, const std::string& cost,
                 std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {SHARDCTL_PATH, "plan", trace, "--manifest", manifest, "--cost", cost, "--json"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  Plan p;
  p.run = RunCommand(argv, kCommandTimeout);
  std::istringstream lines(p.run.out);
  std::string line;
  while (std::getline(lines, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    p.by_policy[j["policy"].get<std::string>()] = j;
  }
  return p;
}

// Checks one policy's object: decisions {per_layer, skip, root, replicate}, hangs, seconds per
// step, bytes gathered per rank per step, peak bytes.
void ExpectPolicy(const Plan& p, const std::string& policy, std::vector<int> decisions, int hangs, double seconds,
                  double gathered, int64_t peak) {
  SCOPED_TRACE(policy);
  ASSERT_EQ(p.by_policy.count(policy), 1u) << p.run.out << p.run.err;
  const nlohmann::json& j = p.by_policy.at(policy);
  EXPECT_EQ(j["decisions"]["per_layer"], decisions[0]);
  EXPECT_EQ(j["decisions"]["skip"], decisions[1]);
  EXPECT_EQ(j["decisions"]["root"], decisions[2]);
  EXPECT_EQ(j["decisions"]["replicate"], decisions[3]);
  EXPECT_EQ(j["hang_microbatches"], hangs);
  EXPECT_EQ(j["safe"], hangs == 0);
  EXPECT_NEAR(j["seconds_per_step"].get<double>(), seconds, kEps);
  EXPECT_NEAR(j["gathered_bytes_per_rank_per_step"].get<double>(), gathered, kEps);
  EXPECT_EQ(j["peak_frozen_bytes_per_rank"], peak);
}

TEST(ShardctlPlanTest, EveryPolicyOnAUniformADivergentAndAnEmptyMicrobatch) {
  TempDir dir;
  const Plan p = RunPlanJson(Write(dir, "t.jsonl", kTrace), Write(dir, "m.json", kManifest),
                             Write(dir, "c.json", kCost));
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  EXPECT_THAT(p.run.err, IsEmpty());
  ASSERT_EQ(p.by_policy.size(), 6u) << p.run.out;
  // Step 0 holds (0,0) and (0,1), step 1 holds (1,0); each microbatch adds 0.1 s.
  // root: 0.025 + 0.015 | 0.005 -> (0.24 + 0.105) / 2; 1000 bytes a microbatch.
  ExpectPolicy(p, "root", {0, 0, 3, 0}, 0, 0.1725, 1500, 1000);
  // replicate, built before training: 0.02 + 0.01 | 0 -> (0.23 + 0.1) / 2; never gathers.
  ExpectPolicy(p, "replicate", {0, 0, 0, 3}, 0, 0.165, 0, 1000);
  // static per_layer: 0.03 + 0.015 (ranks 1 and 0 disagree: it hangs) | 0; peak the largest unit.
  ExpectPolicy(p, "per_layer", {2, 1, 0, 0}, 1, 0.1725, 1500, 600);
  // dummy: every rank runs the module as often as any rank does anywhere in the trace (2),
  // in every microbatch, with dummy inputs where it has none (it cannot know that nobody
  // else calls it): 2 x 0.015 a microbatch -> (0.26 | 0.13) / 2; 2000 bytes a microbatch.
  ExpectPolicy(p, "dummy", {3, 0, 0, 0}, 0, 0.195, 3000, 600);
  // The engine under policy per_layer: per_layer 0.03, root 0.015 (divergent), skip 0.
  ExpectPolicy(p, "sc_per_layer", {1, 1, 1, 0}, 0, 0.1725, 1500, 1000);
  // Cost-aware auto prices (0,0)'s two calls as root 0.025 < per_layer 0.03 (gathered once):
  // (0.125 + 0.115 | 0.1) / 2; 1000 bytes gathered in each of step 0's microbatches.
  ExpectPolicy(p, "auto", {0, 1, 2, 0}, 0, 0.17, 1000, 1000);
  for (const auto& [policy, j] : p.by_policy) {
    EXPECT_EQ(j["best"], policy == "replicate") << policy;
    EXPECT_EQ(j["fits"], true) << policy;
    EXPECT_EQ(j["steps"], 2);
    EXPECT_EQ(j["group_microbatches"], 3);
  }
}

// Fallback padded under a budget below the module (800 < 1000): the divergent (0,1) is padded
// to rank 0's one call (0.015 s, 1000 bytes gathered on every rank, one unit held) instead of
// root over the budget; cost-aware auto decides the same (root does not fit (0,0) either).
TEST(ShardctlPlanTest, FallbackPaddedKeepsDivergentMicrobatchesWithinTheBudget) {
  TempDir dir;
  const Plan p = RunPlanJson(Write(dir, "t.jsonl", kTrace), Write(dir, "m.json", kManifest),
                             Write(dir, "c.json", kCost),
                             {"--budget-bytes", "800", "--fallback", "padded", "--policies", "sc_per_layer,auto"});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  for (const char* policy : {"sc_per_layer", "auto"}) {
    ExpectPolicy(p, policy, {1, 1, 0, 0}, 0, 0.1725, 1500, 600);
    EXPECT_EQ(p.by_policy.at(policy)["decisions"]["padded"], 1) << policy;
    EXPECT_EQ(p.by_policy.at(policy)["fits"], true) << policy;
  }
  const Plan root = RunPlanJson(Write(dir, "t.jsonl", kTrace), Write(dir, "m.json", kManifest),
                                Write(dir, "c.json", kCost), {"--budget-bytes", "800", "--policies", "sc_per_layer"});
  EXPECT_EQ(root.by_policy.at("sc_per_layer")["fits"], false) << "fallback root holds the whole module";
  const testing::RunResult bad = RunCommand({SHARDCTL_PATH, "plan", dir.File("t.jsonl"), "--manifest",
                                             dir.File("m.json"), "--cost", dir.File("c.json"), "--fallback", "dummy"},
                                            kCommandTimeout);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--fallback"));
}

TEST(ShardctlPlanTest, ABudgetRulesOutWhatHoldsTheWholeModule) {
  TempDir dir;
  const Plan p = RunPlanJson(Write(dir, "t.jsonl", kTrace), Write(dir, "m.json", kManifest),
                             Write(dir, "c.json", kCost), {"--budget-bytes", "800"});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  // Only the per-layer placements keep within 800 bytes; static per_layer hangs.
  for (const auto& [policy, j] : p.by_policy) {
    EXPECT_EQ(j["fits"], policy == "per_layer" || policy == "dummy") << policy;
    EXPECT_EQ(j["best"], policy == "dummy") << policy;
    EXPECT_EQ(j["budget_bytes"], 800);
  }
}

// 12 microbatches of step 0 in which both ranks call the module once.
std::string UniformTrace(const TempDir& dir) {
  std::string text;
  for (int mb = 0; mb < 12; ++mb) {
    for (int rank = 0; rank < 2; ++rank) {
      absl::StrAppend(&text, R"({"rank":)", rank, R"(,"step":0,"microbatch":)", mb, R"(,"calls":{"visual":1}})",
                      "\n");
    }
  }
  return Write(dir, "uniform.jsonl", text);
}

TEST(ShardctlPlanTest, AutoReplaysTheEnginesPromotionMicrobatchByMicrobatch) {
  TempDir dir;
  const std::string trace = UniformTrace(dir), manifest = Write(dir, "m.json", kManifest),
                    cost = Write(dir, "c.json", kCost);
  // The module fits a budget of 2000. Cost-aware auto: the first per_layer microbatch (0.015 s)
  // would have cost 0.005 s less on a replica, as much as building one (G): promoted from the
  // 2nd microbatch on, which builds it (G + F = 0.015 s, 1000 bytes); the 10 after it run on
  // the resident replica (F = 0.01 s). 12 x 0.1 + 0.015 + 0.015 + 10 x 0.01.
  const Plan fits = RunPlanJson(trace, manifest, cost, {"--budget-bytes", "2000", "--policies", "auto,sc_per_layer"});
  ASSERT_EQ(fits.run.exit_code, 0) << fits.run.err;
  ExpectPolicy(fits, "auto", {1, 0, 0, 11}, 0, 1.33, 2000, 1000);
  // shardcoord's per_layer never promotes: 12 x (0.1 + 0.015).
  ExpectPolicy(fits, "sc_per_layer", {12, 0, 0, 0}, 0, 1.38, 12000, 600);
  EXPECT_EQ(fits.by_policy.at("auto")["best"], true);
  // Within 999 bytes the replica does not fit: auto stays per_layer.
  const Plan tight = RunPlanJson(trace, manifest, cost, {"--budget-bytes", "999", "--policies", "auto"});
  ASSERT_EQ(tight.run.exit_code, 0) << tight.run.err;
  ExpectPolicy(tight, "auto", {12, 0, 0, 0}, 0, 1.38, 12000, 600);
}

TEST(ShardctlPlanTest, AStepTakesAsLongAsItsSlowestGroup) {
  TempDir dir;
  // 4 ranks, groups of 2 (the cost file's group size): group 1 runs the module twice in
  // step 0, group 0 twice in step 1. Under replicate each step's slowest group takes
  // 0.1 + 2 x 0.01; the mean of each group's steps would have been 0.11.
  const std::string trace = Write(dir, "t.jsonl",
                                  R"({"rank":2,"step":0,"microbatch":0,"calls":{"visual":2}}
{"rank":3,"step":0,"microbatch":0,"calls":{"visual":2}}
{"rank":0,"step":1,"microbatch":0,"calls":{"visual":2}}
{"rank":1,"step":1,"microbatch":0,"calls":{"visual":2}}
)");
  const Plan p = RunPlanJson(trace, Write(dir, "m.json", kManifest), Write(dir, "c.json", kCost),
                             {"--policies", "replicate,auto"});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  ExpectPolicy(p, "replicate", {0, 0, 0, 4}, 0, 0.12, 0, 1000);
  // Cost-aware auto gathers each group's tower once (root: 0.005 + 2 x 0.01 < 2 x 0.015).
  ExpectPolicy(p, "auto", {0, 2, 2, 0}, 0, 0.125, 1000, 1000);
  EXPECT_EQ(p.by_policy.at("auto")["groups"], 2);
}

TEST(ShardctlPlanTest, GroupsTheTraceNeverNamesSkipEveryMicrobatch) {
  TempDir dir;
  const Plan p = RunPlanJson(Write(dir, "t.jsonl", kTrace), Write(dir, "m.json", kManifest),
                             Write(dir, "c.json", kCost), {"--world-size", "6", "--policies", "root,auto"});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  // Groups 1 and 2 run nothing: root still gathers there (0.105 s a microbatch, below group
  // 0's), auto skips. The slowest group is group 0, as before.
  ExpectPolicy(p, "root", {0, 0, 9, 0}, 0, 0.1725, 1500, 1000);
  ExpectPolicy(p, "auto", {0, 7, 2, 0}, 0, 0.17, 1000, 1000);
  EXPECT_EQ(p.by_policy.at("auto")["group_microbatches"], 9);
}

TEST(ShardctlPlanTest, AManifestModuleWithoutCostsTakesNoTimeButItsBytes) {
  TempDir dir;
  const std::string manifest = Write(dir, "m.json", R"({"modules":[{"name":"visual","param_bytes":1000,
      "units":[{"name":"blocks.0","param_bytes":400},{"name":"blocks.1","param_bytes":600}]},
      {"name":"audio_tower","param_bytes":500}]})");
  const Plan p = RunPlanJson(Write(dir, "t.jsonl", kTrace), manifest, Write(dir, "c.json", kCost),
                             {"--policies", "root"});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  EXPECT_THAT(p.run.err, HasSubstr("warning: " + dir.File("c.json") +
                                   ": no costs for module 'audio_tower' of the manifest; it is taken to cost nothing"));
  // Root gathers audio_tower too (500 bytes a microbatch), in no time.
  ExpectPolicy(p, "root", {0, 0, 6, 0}, 0, 0.1725, 2250, 1500);
}

TEST(ShardctlPlanTest, TheTableReadsATraceFromStdin) {
  TempDir dir;
  const std::string trace = Write(dir, "t.jsonl", kTrace), manifest = Write(dir, "m.json", kManifest),
                    cost = Write(dir, "c.json", kCost);
  auto r = RunCommand({"/bin/sh", "-c",
                       absl::StrCat("cat '", trace, "' | '", SHARDCTL_PATH, "' plan - --manifest '", manifest,
                                    "' --cost '", cost, "'")},
                      kCommandTimeout);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("<stdin>: 2 ranks in 1 group of 2, 3 microbatches in 2 steps"),
                           HasSubstr("POLICY"), HasSubstr("HANGS"),
                           HasSubstr("best safe policy: replicate (0.1650 s per step, peak 1000 B per rank)")));
  // The per_layer row says it hangs, once.
  const size_t row = r.out.find("\nper_layer ");
  ASSERT_NE(row, std::string::npos) << r.out;
  const std::string line = r.out.substr(row + 1, r.out.find('\n', row + 1) - row - 1);
  EXPECT_THAT(line, AllOf(HasSubstr(" 1 "), HasSubstr("HANGS"))) << line;
}

// The decisions by kind that `shardctl replay` reports on stderr ("group decisions:
// per_layer=N skip=N root=N replicate=N").
std::vector<int> ReplayCounts(const std::string& err) {
  std::smatch m;
  const std::regex counts(R"(group decisions: per_layer=(\d+) skip=(\d+) root=(\d+) replicate=(\d+))");
  if (!std::regex_search(err, m, counts)) return {};
  return {std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), std::stoi(m[4])};
}

// The bundled trace: 8 ranks, 3 modules, uniform, mixed and empty microbatches.
const std::string kMixedTrace = absl::StrCat(SHARDCOORD_SOURCE_DIR, "/examples/traces/mixed_8ranks.jsonl");

std::string MixedManifest(const TempDir& dir) {
  return Write(dir, "m.json", R"({"modules":[
      {"name":"vision_tower","param_bytes":4096,"units":[{"name":"layers.0","param_bytes":2048},
                                                        {"name":"layers.1","param_bytes":2048}]},
      {"name":"multi_modal_projector","param_bytes":512},{"name":"audio_tower","param_bytes":1024}]})");
}

// Replays kMixedTrace through a real (embedded) coordinator in groups of 4 under
// `daemon_policy` with fallback root and `budget` (plus `replay_extra`), and expects the
// planner's `policy`, given `cost` and the same budget, to count the same decisions.
void ExpectThePlannerCountsWhatTheDaemonDecided(const std::string& manifest, const std::string& cost,
                                                const std::string& budget, const std::string& policy,
                                                const std::string& daemon_policy,
                                                std::vector<std::string> replay_extra = {}) {
  std::vector<std::string> argv = {SHARDCTL_PATH, "replay", kMixedTrace, "--group-size", "4", "--manifest", manifest,
                                   "--policy", daemon_policy, "--fallback", "root", "--memory-budget-bytes", budget};
  argv.insert(argv.end(), replay_extra.begin(), replay_extra.end());
  auto replay = RunCommand(argv, kCommandTimeout);
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
  const std::vector<int> daemon = ReplayCounts(replay.err);
  ASSERT_EQ(daemon.size(), 4u) << replay.err;
  const Plan p = RunPlanJson(kMixedTrace, manifest, cost,
                             {"--world-size", "8", "--group-size", "4", "--budget-bytes", budget, "--policies", policy});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  const nlohmann::json& d = p.by_policy.at(policy)["decisions"];
  EXPECT_EQ(std::vector<int>({d["per_layer"].get<int>(), d["skip"].get<int>(), d["root"].get<int>(),
                              d["replicate"].get<int>()}),
            daemon);
}

TEST(ShardctlPlanTest, AutoDecidesAsTheDaemonDoesInAReplay) {
  TempDir dir;
  // The daemon and the planner must count the same decisions, with promotion off, on for the
  // small modules only, and on for all of them.
  const std::string manifest = MixedManifest(dir);
  // Replay's simulated ranks report no costs, so the daemon decides by counting: the planner
  // is given no costs either (each module then costs nothing, with a warning) and counts too.
  const std::string cost =
      Write(dir, "c.json", R"({"format":"shardcoord.cost/v1","other_seconds_per_microbatch":0.1,"modules":[]})");
  for (const std::string budget : {"0", "1024", "4096"}) {
    for (const auto& [policy, daemon_policy] : {std::pair{"auto", "auto"}, std::pair{"sc_per_layer", "per_layer"}}) {
      SCOPED_TRACE(absl::StrCat(policy, " budget ", budget));
      ExpectThePlannerCountsWhatTheDaemonDecided(manifest, cost, budget, policy, daemon_policy);
    }
  }
}

TEST(ShardctlPlanTest, CostAwareAutoDecidesAsTheDaemonDoesWhenTheRanksReportTheCosts) {
  TempDir dir;
  // The same trace and manifest, but every replayed rank reports the cost file before its first
  // plan (as a measuring trainer would): the daemon's auto decides by cost from the first
  // microbatch, and the planner, given the same file, must count the same decisions.
  const std::string manifest = MixedManifest(dir);
  const std::string cost = Write(dir, "c.json", R"({"format":"shardcoord.cost/v1","other_seconds_per_microbatch":0.1,
      "modules":[{"name":"vision_tower","forward_seconds_per_call":0.01,"units":[{"name":"layers.0",
                  "gather_seconds":0.002},{"name":"layers.1","gather_seconds":0.002}]},
                 {"name":"audio_tower","forward_seconds_per_call":0.004,"units":[{"name":"whole","gather_seconds":0.001}]}]})");
  for (const std::string budget : {"0", "1024", "4096"}) {
    SCOPED_TRACE(absl::StrCat("budget ", budget));
    ExpectThePlannerCountsWhatTheDaemonDecided(manifest, cost, budget, "auto", "auto", {"--cost", cost});
  }
}

// ---------------------------------------------------------------------------------------
// The decoder priced per token: a trace whose lines give "tokens" and a cost file with
// other_seconds_per_token. The rest of a group microbatch is then
//   max(0, 0.1 + 0.00001 x (T - 1000)),  T the most tokens of any member's line (0 without one),
// instead of 0.1 + other_seconds_per_call (0.05 here) x the most calls of any member.

constexpr char kTokenCost[] = R"({"format":"shardcoord.cost/v1","group_size":2,"other_seconds_per_microbatch":0.1,
  "other_seconds_per_token":0.00001,"other_tokens_per_microbatch":1000,
  "modules":[{"name":"visual","forward_seconds_per_call":0.01,"other_seconds_per_call":0.05,
    "units":[{"name":"blocks.0","gather_seconds":0.002},{"name":"blocks.1","gather_seconds":0.003}]}]})";

// kTrace's calls with tokens: (0,0) 3000 and 5000 -> 5000: 0.14 s; (0,1) 1500 and 1000 -> 1500:
// 0.105 s; (1,0) rank 0 200, rank 1 no line -> 200: 0.1 - 0.008 = 0.092 s.
constexpr char kTokenTrace[] = R"({"rank":0,"step":0,"microbatch":0,"calls":{"visual":2},"tokens":3000}
{"rank":1,"step":0,"microbatch":0,"calls":{"visual":2},"tokens":5000}
{"rank":0,"step":0,"microbatch":1,"calls":{"visual":1},"tokens":1500}
{"rank":1,"step":0,"microbatch":1,"calls":{"visual":0},"tokens":1000}
{"rank":0,"step":1,"microbatch":0,"calls":{"visual":0},"tokens":200}
)";

TEST(ShardctlPlanTest, ATraceWithTokensIsPricedPerTokenOnTheBusiestMember) {
  TempDir dir;
  const Plan p = RunPlanJson(Write(dir, "t.jsonl", kTokenTrace), Write(dir, "m.json", kManifest),
                             Write(dir, "c.json", kTokenCost), {"--policies", "root,replicate,dummy"});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  EXPECT_THAT(p.run.err, IsEmpty());
  // root: (0.14 + 0.025 + 0.105 + 0.015 | 0.092 + 0.005) / 2; other_seconds_per_call is not added.
  ExpectPolicy(p, "root", {0, 0, 3, 0}, 0, (0.285 + 0.097) / 2, 1500, 1000);
  // replicate (resident): (0.14 + 0.02 + 0.105 + 0.01 | 0.092) / 2.
  ExpectPolicy(p, "replicate", {0, 0, 0, 3}, 0, (0.275 + 0.092) / 2, 0, 1000);
  // dummy: 2 x 0.015 in every microbatch: (0.14 + 0.03 + 0.105 + 0.03 | 0.092 + 0.03) / 2.
  ExpectPolicy(p, "dummy", {3, 0, 0, 0}, 0, (0.305 + 0.122) / 2, 3000, 600);
  for (const auto& [policy, j] : p.by_policy) EXPECT_EQ(j["other_priced_by"], "tokens") << policy;
}

TEST(ShardctlPlanTest, ThePerTokenPriceNeverGoesBelowZero) {
  TempDir dir;
  // Priced at 1 s for 2000 tokens, 0.001 s a token more: (1,0)'s 200 tokens would be -0.8 s.
  const std::string cost = Write(dir, "c.json", R"({"format":"shardcoord.cost/v1","other_seconds_per_microbatch":1,
      "other_seconds_per_token":0.001,"other_tokens_per_microbatch":2000,
      "modules":[{"name":"visual","forward_seconds_per_call":0.01,"units":[]}]})");
  const Plan p = RunPlanJson(Write(dir, "t.jsonl", kTokenTrace), Write(dir, "m.json", kManifest), cost,
                             {"--group-size", "2", "--policies", "replicate"});
  ASSERT_EQ(p.run.exit_code, 0) << p.run.err;
  // Step 0: 1 + 3 (5000 tokens) + 0.02, 1 - 0.5 (1500) + 0.01; step 1: max(0, -0.8) + 0.
  ExpectPolicy(p, "replicate", {0, 0, 0, 3}, 0, (4.02 + 0.51 + 0.0) / 2, 0, 1000);
}

TEST(ShardctlPlanTest, WithoutTokensOnBothSidesTheRestIsPricedPerCallAsBefore) {
  TempDir dir;
  const std::string manifest = Write(dir, "m.json", kManifest);
  // The per-token cost file on kTrace (no tokens): per call, with a warning naming both files.
  // root: (0.1 + 0.1 + 0.025 + 0.1 + 0.05 + 0.015 | 0.1 + 0.005) / 2.
  const std::string trace = Write(dir, "t.jsonl", kTrace), cost = Write(dir, "c.json", kTokenCost);
  const Plan old_trace = RunPlanJson(trace, manifest, cost, {"--policies", "root"});
  ASSERT_EQ(old_trace.run.exit_code, 0) << old_trace.run.err;
  ExpectPolicy(old_trace, "root", {0, 0, 3, 0}, 0, (0.39 + 0.105) / 2, 1500, 1000);
  EXPECT_EQ(old_trace.by_policy.at("root")["other_priced_by"], "calls");
  EXPECT_THAT(old_trace.run.err, HasSubstr(absl::StrCat("shardctl plan: warning: ", cost, " prices tokens but ", trace,
                                                        " gives none: the rest of each microbatch is priced per call")));
  // kTokenTrace with kCost (no price): per call as in EveryPolicyOn..., with the other warning.
  const std::string token_trace = Write(dir, "tokens.jsonl", kTokenTrace), old_cost = Write(dir, "old.json", kCost);
  const Plan old_cost_plan = RunPlanJson(token_trace, manifest, old_cost, {"--policies", "root"});
  ASSERT_EQ(old_cost_plan.run.exit_code, 0) << old_cost_plan.run.err;
  ExpectPolicy(old_cost_plan, "root", {0, 0, 3, 0}, 0, 0.1725, 1500, 1000);
  EXPECT_EQ(old_cost_plan.by_policy.at("root")["other_priced_by"], "calls");
  EXPECT_THAT(old_cost_plan.run.err,
              HasSubstr(absl::StrCat("shardctl plan: warning: ", token_trace, " gives tokens but ", old_cost,
                                     " has no other_seconds_per_token: the rest of each microbatch is priced per call")));
  // Neither: today's numbers, no warning.
  const Plan neither = RunPlanJson(trace, manifest, old_cost, {"--policies", "root"});
  ASSERT_EQ(neither.run.exit_code, 0) << neither.run.err;
  ExpectPolicy(neither, "root", {0, 0, 3, 0}, 0, 0.1725, 1500, 1000);
  EXPECT_THAT(neither.run.err, IsEmpty());
}

TEST(ShardctlPlanTest, TheTableSaysTheTokenPrice) {
  TempDir dir;
  const std::string trace = Write(dir, "t.jsonl", kTokenTrace), manifest = Write(dir, "m.json", kManifest),
                    cost = Write(dir, "c.json", kTokenCost);
  auto r = RunCommand({SHARDCTL_PATH, "plan", trace, "--manifest", manifest, "--cost", cost}, kCommandTimeout);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("; other 0.1000 s per microbatch of 1000 tokens, 1e-05 s per token more; budget none"));
}

TEST(ShardctlPlanTest, BadTokensAreExitTwoNamingTheLine) {
  TempDir dir;
  const std::string manifest = Write(dir, "m.json", kManifest), cost = Write(dir, "c.json", kTokenCost);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"rank":0,"step":0,"microbatch":0,"tokens":-3})", ":1: 'tokens' must be a non-negative integer"},
      {"{\"rank\":0,\"step\":0,\"microbatch\":0,\"tokens\":7}\n{\"rank\":1,\"step\":0,\"microbatch\":0}",
       ":2: 'tokens' is missing, but line 1 gives it"},
  };
  for (const auto& [text, error] : cases) {
    const std::string trace = Write(dir, "bad.jsonl", text);
    auto r = RunCommand({SHARDCTL_PATH, "plan", trace, "--manifest", manifest, "--cost", cost}, kCommandTimeout);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(trace + error));
    EXPECT_THAT(r.out, IsEmpty());
  }
}

TEST(ShardctlPlanTest, BadInputIsExitTwoWithOneLineNamingIt) {
  TempDir dir;
  const std::string trace = Write(dir, "t.jsonl", kTrace), manifest = Write(dir, "m.json", kManifest),
                    cost = Write(dir, "c.json", kCost);
  const std::string unknown = Write(dir, "unknown.json", R"({"format":"shardcoord.cost/v1",
      "other_seconds_per_microbatch":0.1,"modules":[{"name":"audio","forward_seconds_per_call":1,"units":[]}]})");
  const std::string negative = Write(dir, "negative.json", R"({"format":"shardcoord.cost/v1",
      "other_seconds_per_microbatch":0.1,"modules":[{"name":"visual","forward_seconds_per_call":-1,"units":[]}]})");
  const std::string audio_trace =
      Write(dir, "audio.jsonl", R"({"rank":0,"step":0,"microbatch":0,"calls":{"audio_tower":1}}
{"rank":1,"step":0,"microbatch":0})");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{trace, "--manifest", manifest, "--cost", unknown}, "module 'audio' is not in the manifest [visual]"},
      {{trace, "--manifest", manifest, "--cost", negative},
       "modules[0] ('visual'): 'forward_seconds_per_call' must be a number of seconds from 0 to 86400, got -1"},
      {{audio_trace, "--manifest", manifest, "--cost", cost},
       "the trace names module 'audio_tower' which is not in the manifest [visual]"},
      {{trace, "--manifest", manifest, "--cost", cost, "--group-size", "3"}, "group size 3 does not divide world size 2"},
      {{trace, "--manifest", manifest, "--cost", cost, "--world-size", "1"}, "names rank 1 but --world-size is 1"},
      {{trace, "--manifest", manifest, "--cost", cost, "--policies", "root,fastest"}, "'fastest' is unknown"},
      {{trace, "--manifest", manifest}, "--cost is required"},
  };
  for (const auto& [args, error] : cases) {
    std::vector<std::string> argv = {SHARDCTL_PATH, "plan"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = RunCommand(argv, kCommandTimeout);
    EXPECT_EQ(r.exit_code, 2) << error << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(error));
    EXPECT_THAT(r.out, IsEmpty()) << error;
    EXPECT_THAT(r.err, Not(HasSubstr("\n\n"))) << error;
  }
}

}  // namespace
}  // namespace shardcoord
