// Communicator tests with real processes: a real shardcoordd is the rendezvous, rank
// processes (comm_rank, linking the shared worker library) run checked Gloo collectives
// over TCP; ranks are killed with SIGKILL and replaced.
#include <gmock/gmock.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "shardcoord/v1/coordinator.pb.h"
#include "support/daemon.h"
#include "support/subprocess.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

using ::testing::HasSubstr;
using testing::ReadFile;
using testing::RunCommand;
using testing::Subprocess;
using testing::TempDir;
using testing::WaitUntil;

constexpr int kHeartbeatTimeoutMs = 1500;

class CommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = testing::Daemon::Start(dir_.path(), {"--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms",
                                                  std::to_string(kHeartbeatTimeoutMs)});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }

  std::unique_ptr<Subprocess> StartRank(int rank, const std::string& comm, int iterations, int interval_ms,
                                        bool rejoin, const std::string& tag = "") {
    std::vector<std::string> argv = {COMM_RANK_PATH, "--coordinator", daemon_->address(), "--job", "cj",
                                     "--rank", std::to_string(rank), "--world-size", "4", "--group-size", "2",
                                     "--comm", comm, "--iterations", std::to_string(iterations),
                                     "--interval-ms", std::to_string(interval_ms)};
    if (rejoin) argv.push_back("--rejoin");
    const std::string base = dir_.File(absl::StrCat("rank", rank, tag));
    return std::make_unique<Subprocess>(argv, base + ".out", base + ".err");
  }

  v1::ListCommsResponse Comms() {
    auto r = RunCommand({SHARDCTL_PATH, "comms", "--json", "--coordinator", daemon_->address()}, absl::Seconds(30));
    v1::ListCommsResponse parsed;
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &parsed).ok()) << r.out;
    return parsed;
  }

  static const v1::CommStatus* Find(const v1::ListCommsResponse& all, const std::string& name) {
    for (const auto& c : all.comms()) {
      if (c.name() == name) return &c;
    }
    return nullptr;
  }

  static int CountLines(const std::string& text, const std::string& needle) {
    int n = 0;
    for (absl::string_view line : absl::StrSplit(text, '\n')) n += absl::StrContains(line, needle);
    return n;
  }

  TempDir dir_;
  std::unique_ptr<testing::Daemon> daemon_;
};

TEST_F(CommTest, GroupAndWorldCollectivesAreCorrectAcrossProcesses) {
  for (const std::string comm : {"group", "world"}) {
    SCOPED_TRACE(comm);
    std::vector<std::unique_ptr<Subprocess>> ranks;
    for (int r = 0; r < 4; ++r) ranks.push_back(StartRank(r, comm, 30, 0, false, comm));
    for (int r = 0; r < 4; ++r) {
      auto code = ranks[r]->Wait(absl::Seconds(60));
      ASSERT_TRUE(code.has_value()) << "rank " << r << " hung";
      EXPECT_EQ(*code, 0) << ReadFile(ranks[r]->stderr_path());
      EXPECT_EQ(CountLines(ReadFile(ranks[r]->stdout_path()), " ok"), 30);
    }
  }
  auto comms = Comms();
  for (const char* name : {"group/0", "group/1", "world"}) {
    const v1::CommStatus* c = Find(comms, name);
    ASSERT_NE(c, nullptr) << name;
    EXPECT_EQ(c->epoch(), 1) << name;
    EXPECT_EQ(c->epochs_aborted(), 0) << name;
  }
  EXPECT_THAT(Find(comms, "world")->ranks(), ::testing::ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(Find(comms, "group/1")->ranks(), ::testing::ElementsAre(2, 3));
}

TEST_F(CommTest, KillNineAbortsTheEpochAndAReplacementFormsTheNext) {
  constexpr int kIterations = 400;
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < 4; ++r) ranks.push_back(StartRank(r, "world", kIterations, 10, /*rejoin=*/true));
  // Wait until the collectives run.
  ASSERT_TRUE(WaitUntil([&] { return CountLines(ReadFile(ranks[0]->stdout_path()), " ok") >= 20; },
                        absl::Seconds(30)));

  ranks[3]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  // Every survivor's collective fails with ABORTED naming rank 3, quickly.
  for (int r : {0, 1, 2}) {
    ASSERT_TRUE(WaitUntil([&] { return absl::StrContains(ReadFile(ranks[r]->stderr_path()), "ABORTED"); },
                          absl::Milliseconds(kHeartbeatTimeoutMs) + testing::kLoadSlack))
        << "rank " << r << " did not see the abort: " << ReadFile(ranks[r]->stderr_path());
    EXPECT_THAT(ReadFile(ranks[r]->stderr_path()), HasSubstr("rank 3"));
  }
  EXPECT_LT(absl::Now() - killed, absl::Milliseconds(kHeartbeatTimeoutMs) + testing::kLoadSlack);

  // Every survivor acknowledges the abort; then the epoch is ABORTED (not just ABORTING).
  v1::ListCommsResponse comms;
  ASSERT_TRUE(WaitUntil(
      [&] {
        comms = Comms();
        const v1::CommStatus* w = Find(comms, "world");
        return w != nullptr && w->state() == v1::COMM_STATE_ABORTED;
      },
      testing::kLoadSlack));
  const v1::CommStatus* world = Find(comms, "world");
  EXPECT_EQ(world->epoch(), 1);
  for (const auto& m : world->members()) {
    EXPECT_EQ(m.state(), m.rank() == 3 ? "dead" : "aborted") << "rank " << m.rank();
  }
  auto status = RunCommand({SHARDCTL_PATH, "status", "--coordinator", daemon_->address()}, absl::Seconds(10));
  EXPECT_THAT(status.out, HasSubstr("comm: world epoch 1 aborted: rank 3 declared dead"));
  EXPECT_THAT(world->lost_ranks(), ::testing::ElementsAre(3));
  EXPECT_THAT(world->abort_reason(), HasSubstr("rank 3 declared dead"));

  // A replacement registers as rank 3: epoch 2 forms and everyone finishes correctly.
  ranks[3] = StartRank(3, "world", kIterations, 0, true, "-replacement");
  for (int r = 0; r < 4; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(90));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " hung";
    EXPECT_EQ(*code, 0) << ReadFile(ranks[r]->stderr_path());
    EXPECT_THAT(ReadFile(ranks[r]->stdout_path()), HasSubstr(absl::StrCat("iteration ", kIterations - 1, " epoch 2 ok")));
  }
  comms = Comms();
  world = Find(comms, "world");
  EXPECT_EQ(world->epoch(), 2);
  EXPECT_EQ(world->epochs_aborted(), 1);
}

TEST_F(CommTest, ARankThatStopsIssuingCollectivesIsNamedAsBehind) {
  // A separate daemon with a short behind threshold.
  TempDir dir;
  auto d = testing::Daemon::Start(dir.path(), {"--heartbeat-interval-ms", "100", "--behind-threshold-ms", "1000"});
  ASSERT_TRUE(d.ok()) << d.status();
  // Rank 2 stalls (alive, heartbeating, issuing no collective) until the test has seen what
  // it expects and creates this file; the 120 s cap only bounds a failing run.
  const std::string release = dir.File("release");
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < 4; ++r) {
    std::vector<std::string> argv = {COMM_RANK_PATH, "--coordinator", (*d)->address(), "--job", "lag", "--rank",
                                     std::to_string(r), "--world-size", "4", "--group-size", "4", "--comm", "world",
                                     "--iterations", "20", "--op-timeout-ms", "150000"};
    if (r == 2) {
      for (const char* a : {"--stall-at", "5", "--stall-ms", "120000"}) argv.push_back(a);
      argv.insert(argv.end(), {"--stall-until", release});
    }
    ranks.push_back(std::make_unique<Subprocess>(argv, dir.File(absl::StrCat("r", r, ".out")),
                                                 dir.File(absl::StrCat("r", r, ".err"))));
  }
  // Rank 2 stalled before iteration 5's collectives: 1 agreement + 3 per iteration. The
  // others' progress reaches the coordinator with their heartbeats, one by one: wait for
  // the complete picture, not the first snapshot that names someone.
  std::string behind;
  const bool named = WaitUntil(
      [&] {
        auto r = RunCommand({SHARDCTL_PATH, "comms", "--json", "--coordinator", (*d)->address()}, absl::Seconds(10));
        v1::ListCommsResponse all;
        if (!google::protobuf::util::JsonStringToMessage(r.out, &all).ok()) return false;
        const v1::CommStatus* world = Find(all, "world");
        if (world == nullptr) return false;
        behind = world->behind();
        return absl::StrContains(behind, "rank 2 at collective 16") &&
               absl::StrContains(behind, "ranks 0,1,3 waiting at 17");
      },
      absl::Seconds(60), absl::Milliseconds(200));
  std::ofstream(release).put('\n');
  EXPECT_TRUE(named) << "last behind: '" << behind << "'";
  // The stall ends, everyone finishes: being behind is not a failure.
  for (int r = 0; r < 4; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.has_value());
    EXPECT_EQ(*code, 0) << ReadFile(dir.File(absl::StrCat("r", r, ".err")));
  }
  auto events = RunCommand({SHARDCTL_PATH, "events", "--coordinator", (*d)->address()}, absl::Seconds(10));
  EXPECT_THAT(events.out, HasSubstr("comm_rank_behind"));
}


TEST_F(CommTest, AStoppedRankAbortsCollectivesInFlightOnEverySurvivor) {
  // Rank 3 is frozen (SIGSTOP): its sockets stay open, so the survivors' collectives block
  // on it until Gloo's op timeout (60 s here) unless the coordinator's abort wakes them.
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < 4; ++r) {
    std::vector<std::string> argv = {COMM_RANK_PATH, "--coordinator", daemon_->address(), "--job", "frozen",
                                     "--rank", std::to_string(r), "--world-size", "4", "--group-size", "2",
                                     "--comm", "world", "--iterations", "100000", "--op-timeout-ms", "60000"};
    ranks.push_back(std::make_unique<Subprocess>(argv, dir_.File(absl::StrCat("frozen", r, ".out")),
                                                 dir_.File(absl::StrCat("frozen", r, ".err"))));
  }
  ASSERT_TRUE(WaitUntil([&] { return CountLines(ReadFile(ranks[0]->stdout_path()), " ok") >= 20; },
                        absl::Seconds(30)));
  ranks[3]->Signal(SIGSTOP);
  const absl::Time frozen = absl::Now();
  for (int r : {0, 1, 2}) {
    auto code = ranks[r]->Wait(absl::Milliseconds(kHeartbeatTimeoutMs) + testing::kLoadSlack);
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still blocked in a collective: "
                                  << ReadFile(ranks[r]->stderr_path());
    EXPECT_EQ(*code, 3);
    EXPECT_THAT(ReadFile(ranks[r]->stderr_path()), HasSubstr("ABORTED"));
    EXPECT_THAT(ReadFile(ranks[r]->stderr_path()), HasSubstr("rank 3 declared dead"));
  }
  EXPECT_LT(absl::Now() - frozen, absl::Milliseconds(kHeartbeatTimeoutMs) + testing::kLoadSlack);
  ranks[3]->Signal(SIGKILL);
}

}  // namespace
}  // namespace shardcoord
