// The seed's two-rank regression, ported, plus the case it could not support: real
// vlm_trainer processes (LibTorch, Gloo) under a real shardcoordd, every policy.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <grpcpp/grpcpp.h>

#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"
#include "support/certs.h"
#include "support/daemon.h"
#include "support/subprocess.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::ReadFile;
using testing::Subprocess;
using testing::TempDir;

struct RankResult {
  int exit_code = -1;
  std::vector<std::string> losses;  // Hex floats, bitwise comparable.
  std::string params_hash;
  std::string summary;
  std::string err;
};

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = testing::Daemon::Start(dir_.path(), {"--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "5000"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }

  // Starts a job's rank processes (2 ranks, 1 group unless told).
  std::vector<std::unique_ptr<Subprocess>> Launch(const std::string& policy, const std::string& media,
                                                  std::vector<std::string> extra = {}, int world = 2, int group = 2,
                                                  int steps = 3) {
    const std::string job = absl::StrCat("job", next_job_++);
    std::vector<std::unique_ptr<Subprocess>> procs;
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv = {VLM_TRAINER_PATH, "--coordinator", daemon_->address(), "--job", job,
                                       "--rank", std::to_string(r), "--world-size", std::to_string(world),
                                       "--group-size", std::to_string(group), "--policy", policy, "--media", media,
                                       "--steps", std::to_string(steps), "--accum", "2"};
      argv.insert(argv.end(), extra.begin(), extra.end());
      procs.push_back(std::make_unique<Subprocess>(argv, dir_.File(job + "-" + std::to_string(r) + ".out"),
                                                   dir_.File(job + "-" + std::to_string(r) + ".err"),
                                                   env_));
    }
    return procs;
  }

  // Waits for every rank (bounded) and returns what each printed.
  static std::vector<RankResult> Collect(std::vector<std::unique_ptr<Subprocess>>& procs) {
    std::vector<RankResult> out(procs.size());
    for (size_t r = 0; r < procs.size(); ++r) {
      auto code = procs[r]->Wait(absl::Seconds(180));
      out[r].exit_code = code ? *code : -1;  // -1: it hung.
      out[r].err = ReadFile(procs[r]->stderr_path());
      for (absl::string_view line : absl::StrSplit(ReadFile(procs[r]->stdout_path()), '\n')) {
        std::vector<std::string> f = absl::StrSplit(line, ' ');
        if (f.size() >= 4 && f[0] == "step" && f[2] == "loss") out[r].losses.push_back(f[3]);
        if (f.size() == 4 && f[0] == "final") out[r].params_hash = f[3];
        if (absl::StartsWith(line, "summary")) out[r].summary = std::string(line);
      }
    }
    return out;
  }

  std::vector<RankResult> Train(const std::string& policy, const std::string& media, std::vector<std::string> extra = {},
                                int world = 2, int group = 2) {
    auto procs = Launch(policy, media, std::move(extra), world, group);
    return Collect(procs);
  }

  static void ExpectHealthy(const std::vector<RankResult>& run, size_t steps = 3) {
    for (size_t r = 0; r < run.size(); ++r) {
      ASSERT_EQ(run[r].exit_code, 0) << "rank " << r << ": " << run[r].err;
      ASSERT_EQ(run[r].losses.size(), steps);
      for (const auto& l : run[r].losses) EXPECT_TRUE(std::isfinite(std::strtod(l.c_str(), nullptr))) << l;
      EXPECT_EQ(run[r].params_hash, run[0].params_hash) << "ranks disagree on the trained parameters";
    }
  }

  TempDir dir_;
  std::unique_ptr<testing::Daemon> daemon_;
  int next_job_ = 0;
  std::vector<std::string> env_ = {"SHARDCOORD_LOG_LEVEL=warn"};  // Of every rank process.
};

// Coordinator restart (DESIGN 12) under a real Gloo training job, 8 ranks in 2 groups: the
// daemon is killed mid-training and a new one starts on its address. Every rank resumes
// (its decisions and communicators intact) and the run ends with exactly the parameters of
// the same run without the restart.
TEST_F(TrainerTest, ADaemonKilledMidTrainingAndRestartedChangesNothingButThePause) {
  const std::vector<std::string> extra = {"--image-fraction", "0.5", "--interval-ms", "150"};
  auto reference_procs = Launch("auto", "mixed", extra, /*world=*/8, /*group=*/4, /*steps=*/8);
  auto reference = Collect(reference_procs);
  ExpectHealthy(reference, 8);

  auto procs = Launch("auto", "mixed", extra, 8, 4, 8);
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        v1::StatusRequest req;
        req.set_job_id("job1");
        v1::StatusResponse st;
        return stub->GetStatus(&ctx, req, &st).ok() && st.jobs_size() == 1 && st.jobs(0).microbatches_decided() >= 6;
      },
      absl::Seconds(120)));
  const std::string address = daemon_->address();
  daemon_->process().Signal(SIGKILL);
  ASSERT_TRUE(daemon_->process().Wait(absl::Seconds(10)).has_value());
  auto d = testing::Daemon::Start(dir_.path(), {"--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "5000"},
                                  address, "daemon2");
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = std::move(*d);
  auto restarted = Collect(procs);
  ExpectHealthy(restarted, 8);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(restarted[r].losses, reference[r].losses) << "rank " << r;
    EXPECT_THAT(restarted[r].err, HasSubstr("resumed with coordinator")) << "rank " << r;
  }
  EXPECT_EQ(restarted[0].params_hash, reference[0].params_hash) << "bitwise, as without the restart";
  EXPECT_THAT(daemon_->Stderr(), HasSubstr("event=group_recovered"));
  EXPECT_THAT(daemon_->Stderr(), HasSubstr("event=comm_recovered")) << "communicators kept, not aborted";
  EXPECT_THAT(daemon_->Stderr(), ::testing::Not(HasSubstr("event=comm_aborted")));
}

TEST_F(TrainerTest, RootWithMediaOnRankZeroOnlyDoesNotHang) {
  auto run = Train("root", "rank0");
  ExpectHealthy(run);
  EXPECT_THAT(run[0].summary, HasSubstr("root=12"));
  // The executor's memory counts reached the coordinator: `shardctl ranks` shows them.
  auto ranks = testing::RunCommand({SHARDCTL_PATH, "ranks", "--json", "--coordinator", daemon_->address()},
                                   absl::Seconds(10));
  ASSERT_EQ(ranks.exit_code, 0) << ranks.err;
  EXPECT_THAT(ranks.out, HasSubstr("\"module\":\"vision_tower\""));
  // vision_tower: the rest unit (patch_embed 544 floats, post_layernorm 64) and 3 layers of
  // 1056: 3776 floats (15104 bytes) gathered whole once per microbatch under root, 6
  // microbatches; peak = the 7552-byte shard plus one full buffer.
  EXPECT_THAT(ranks.out, HasSubstr("\"module\":\"vision_tower\",\"resident_bytes\":\"7552\","
                                   "\"peak_bytes\":\"22656\",\"gathered_bytes\":\"90624\"")) << ranks.out;
}

// A secured daemon (TLS and tokens, DESIGN 13) trains exactly as an open one: same
// decisions, bitwise the same parameters.
TEST_F(TrainerTest, AJobOverTlsWithTokensTrainsExactlyAsAnOpenOne) {
  auto open = Train("per_layer", "mixed");
  ExpectHealthy(open);
  auto certs = testing::MakeCertificates(dir_.path());
  ASSERT_TRUE(certs.ok()) << certs.status();
  const std::string tokens = dir_.File("tokens");
  std::ofstream(tokens) << "rank rank-token-0123456789abcdef\n";
  ASSERT_EQ(chmod(tokens.c_str(), 0600), 0);
  daemon_.reset();
  auto d = testing::Daemon::Start(dir_.path(), {"--token-file", tokens, "--tls-cert-file", certs->server_cert, "--tls-key-file",
                                                certs->server_key, "--tls-client-ca-file", certs->ca}, "127.0.0.1:0", "secured");
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = std::move(*d);
  env_.push_back("SHARDCOORD_TOKEN=rank-token-0123456789abcdef");
  env_.push_back("SHARDCOORD_TLS_CA=" + certs->ca);
  env_.push_back("SHARDCOORD_TLS_CERT=" + certs->client_cert);
  env_.push_back("SHARDCOORD_TLS_KEY=" + certs->client_key);
  auto secured = Train("per_layer", "mixed");
  ExpectHealthy(secured);
  EXPECT_EQ(secured[0].summary, open[0].summary);
  EXPECT_EQ(secured[0].params_hash, open[0].params_hash);
  EXPECT_EQ(secured[0].losses, open[0].losses);
}

TEST_F(TrainerTest, PerLayerWithEveryRankSkippingUnderAccumulation) {
  auto run = Train("per_layer", "none");
  ExpectHealthy(run);
  EXPECT_THAT(run[0].summary, HasSubstr("skip=12"));
  EXPECT_THAT(run[0].summary, HasSubstr("gathered_bytes=0"));
}

TEST_F(TrainerTest, ReplicateWithAsymmetricMedia) {
  auto run = Train("replicate", "rank0");
  ExpectHealthy(run);
  EXPECT_THAT(run[0].summary, HasSubstr("replicate=12"));
}

TEST_F(TrainerTest, RootAndPerLayerGiveIdenticalParametersWithUniformMedia) {
  auto root = Train("root", "all");
  auto per_layer = Train("per_layer", "all");
  ExpectHealthy(root);
  ExpectHealthy(per_layer);
  EXPECT_THAT(per_layer[0].summary, HasSubstr("per_layer=12"));
  EXPECT_EQ(root[0].params_hash, per_layer[0].params_hash) << "bitwise after the optimizer steps";
  EXPECT_EQ(root[0].losses, per_layer[0].losses);
}

TEST_F(TrainerTest, PerLayerRequestedWithAsymmetricMediaFallsBackAndMatchesRoot) {
  auto per_layer = Train("per_layer", "rank0");
  auto root = Train("root", "rank0");
  ExpectHealthy(per_layer);
  ExpectHealthy(root);
  EXPECT_THAT(per_layer[0].summary, HasSubstr("fallbacks=12"));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(per_layer[r].losses, root[r].losses) << "rank " << r;
  EXPECT_EQ(per_layer[0].params_hash, root[0].params_hash);
}

// The number after "name=" in a summary line (-1 when absent).
int64_t Field(const std::string& summary, const std::string& name) {
  const size_t at = summary.find(" " + name + "=");
  return at == std::string::npos ? -1 : std::stoll(summary.substr(at + name.size() + 2));
}

// Fallback padded: the rank without images makes gather-only passes, so both ranks issue the
// same all-gathers (a mismatch would hang Gloo or fail it with a size error), compute what the
// unsharded model computes, and hold at most one unit beyond their shards where root would hold
// the whole tower.
TEST_F(TrainerTest, PaddedFallbackWithAsymmetricMediaMatchesTheUnshardedModelAtPerLayersPeak) {
  auto reference = Train("per_layer", "rank0", {"--no-shard"});
  auto padded = Train("per_layer", "rank0", {"--fallback", "padded"});
  auto root = Train("per_layer", "rank0", {"--fallback", "root"});
  ExpectHealthy(reference);
  ExpectHealthy(padded);
  ExpectHealthy(root);
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(padded[r].summary, HasSubstr("padded=12"));
    EXPECT_THAT(padded[r].summary, HasSubstr("fallbacks=12"));
    EXPECT_EQ(padded[r].losses, reference[r].losses) << "rank " << r;
  }
  EXPECT_EQ(padded[0].params_hash, reference[0].params_hash);
  // Both ranks gathered the same bytes (rank 1 only in its passes), and no more than root.
  EXPECT_EQ(Field(padded[0].summary, "gathered_bytes"), Field(padded[1].summary, "gathered_bytes"));
  EXPECT_LT(Field(padded[1].summary, "peak_frozen_bytes"), Field(root[1].summary, "peak_frozen_bytes"));
  // Operators see the passes: one per microbatch (rank 0's one call).
  auto decisions = testing::RunCommand({SHARDCTL_PATH, "decisions", "--coordinator", daemon_->address()},
                                       absl::Seconds(10));
  ASSERT_EQ(decisions.exit_code, 0) << decisions.err;
  EXPECT_THAT(decisions.out, HasSubstr("padded x1")) << decisions.out;
}

TEST_F(TrainerTest, EveryPolicyComputesExactlyWhatTheUnshardedModelDoes) {
  auto reference = Train("auto", "mixed", {"--no-shard", "--image-fraction", "0.6"});
  ExpectHealthy(reference);
  for (const char* policy : {"auto", "per_layer", "root", "replicate"}) {
    SCOPED_TRACE(policy);
    auto run = Train(policy, "mixed", {"--image-fraction", "0.6"});
    ExpectHealthy(run);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(run[r].losses, reference[r].losses) << "rank " << r;
    EXPECT_EQ(run[0].params_hash, reference[0].params_hash);
  }
}

// Towers that train (DESIGN 10) in the LibTorch executor: LoRA adapters on the frozen tower,
// opted in as a trainable module (only the base is sharded; the projector trains). Mixed media
// give per_layer, skip and divergent microbatches; for a trainable module the coordinator
// decides root where padded or replicate was asked. Losses and every trained parameter
// (adapters included) are bitwise those of the unsharded model.
TEST_F(TrainerTest, TowerAdaptersTrainExactlyAsTheUnshardedModel) {
  struct Case {
    std::string policy, media;
    std::vector<std::string> extra;
    std::string decided;  // A decision every rank must have made.
  };
  const std::vector<std::string> adapters = {"--tower-adapters", "4", "--image-fraction", "0.6"};
  std::vector<std::string> padded = adapters;
  padded.insert(padded.end(), {"--fallback", "padded"});
  for (const Case& c : std::vector<Case>{{"per_layer", "all", adapters, "per_layer"},
                                         {"per_layer", "mixed", padded, "root"},
                                         {"replicate", "mixed", adapters, "root"}}) {
    SCOPED_TRACE(c.policy + " " + c.media);
    std::vector<std::string> unsharded = c.extra;
    unsharded.push_back("--no-shard");
    auto reference = Train(c.policy, c.media, unsharded);
    ExpectHealthy(reference);
    auto run = Train(c.policy, c.media, c.extra);
    ExpectHealthy(run);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(run[r].losses, reference[r].losses) << "rank " << r;
      EXPECT_EQ(Field(run[r].summary, "padded"), 0) << run[r].summary;
      EXPECT_EQ(Field(run[r].summary, "replicate"), 0) << run[r].summary;
      EXPECT_GT(Field(run[r].summary, c.decided), 0) << run[r].summary;
    }
    EXPECT_EQ(run[0].params_hash, reference[0].params_hash);
  }
}

// Log lines at warning level or above ("<time> W ..." or "<time> E ...").
std::vector<std::string> Warnings(const std::string& log) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(' ', 2));
    if (f.size() >= 2 && (f[1] == "W" || f[1] == "E")) out.emplace_back(line);
  }
  return out;
}

TEST_F(TrainerTest, FourRanksInTwoGroupsWithSkewedMedia) {
  auto run = Train("auto", "mixed", {"--skew", "0.3"}, /*world=*/4, /*group=*/2);
  ExpectHealthy(run);
  // Quiet success: a clean job logs no warning, in the ranks or in the daemon (alerting on
  // warnings would page on every job otherwise).
  for (int r = 0; r < 4; ++r) EXPECT_THAT(Warnings(run[r].err), ::testing::IsEmpty()) << "rank " << r;
  EXPECT_THAT(Warnings(daemon_->Stderr()), ::testing::IsEmpty());
  EXPECT_FALSE(Warnings("2026-12-02T00:21:42.754 W shardcoord.worker x\n").empty());  // The filter itself.
  auto reference = Train("auto", "mixed", {"--skew", "0.3", "--no-shard"}, 4, 2);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(run[r].losses, reference[r].losses) << "rank " << r;
}

TEST_F(TrainerTest, KillNineOneTrainerAndEveryOtherRankStopsWithItsName) {
  std::vector<std::unique_ptr<Subprocess>> procs;
  for (int r = 0; r < 4; ++r) {
    procs.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{VLM_TRAINER_PATH, "--coordinator", daemon_->address(), "--job", "killed", "--rank",
                                 std::to_string(r), "--world-size", "4", "--group-size", "2", "--media", "mixed",
                                 "--steps", "2000", "--interval-ms", "10"},
        dir_.File(absl::StrCat("killed-", r, ".out")), dir_.File(absl::StrCat("killed-", r, ".err")),
        std::vector<std::string>{"SHARDCOORD_LOG_LEVEL=error"}));
  }
  ASSERT_TRUE(testing::WaitUntil([&] { return absl::StrContains(ReadFile(procs[0]->stdout_path()), "step 20 "); },
                                 absl::Seconds(60)));
  procs[1]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  for (int r : {0, 2, 3}) {  // Rank 0 shares group/0 with it; every rank shares `world`.
    auto code = procs[r]->Wait(absl::Seconds(10) + testing::kLoadSlack);
    ASSERT_TRUE(code.has_value()) << "rank " << r << " hangs after rank 1 died";
    EXPECT_EQ(*code, 3);
    const std::string err = ReadFile(procs[r]->stderr_path());
    EXPECT_THAT(err, HasSubstr("rank 1 declared dead")) << "rank " << r;
    // Issue 25: survivors used to exit without a goodbye, be declared dead in turn, and the
    // others' last error then named them. Each now leaves naming the first cause.
    for (int other : {0, 2, 3}) {
      EXPECT_THAT(err, Not(HasSubstr(absl::StrCat("rank ", other, " declared dead")))) << "rank " << r << ":\n" << err;
    }
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(5) + testing::kLoadSlack);
  // The daemon's view: each survivor left cleanly, naming the first cause.
  const std::string log = daemon_->Stderr();
  for (int r : {0, 2, 3}) {
    const std::string event = absl::StrCat("event=rank_left job=killed rank=", r, " ");
    const size_t at = log.find(event);
    ASSERT_NE(at, std::string::npos) << "rank " << r << " did not leave cleanly:\n" << log;
    const std::string line = log.substr(at, log.find('\n', at) - at);
    EXPECT_THAT(line, HasSubstr("vlm_trainer stopped:"));
    EXPECT_THAT(line, HasSubstr("rank 1 declared dead"));
  }
}

}  // namespace
}  // namespace shardcoord
