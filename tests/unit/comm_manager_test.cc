// Unit tests of the coordinator's communicator management (coordinator_core_comms.cc, DESIGN 4
// and 8): rendezvous, the epoch store, abort and acknowledgement, the next epoch, deadlines.
// Driven through CoordinatorCore with recording sinks and a fake clock: no sockets, no threads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <optional>

#include "coordinator/core/coordinator_core.h"
#include "support/core_fakes.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {
namespace {

using shardcoord::testing::FakeClock;
using shardcoord::testing::RecordingSink;
using ::testing::HasSubstr;

CoordinatorOptions CommTestOptions() {
  CoordinatorOptions o;
  o.heartbeat_interval = absl::Milliseconds(100);
  o.heartbeat_timeout = absl::Milliseconds(1000);
  return o;
}

class CommManagerTest : public ::testing::Test, protected shardcoord::testing::CoreHarness {
 protected:
  explicit CommManagerTest(const CoordinatorOptions& options = CommTestOptions()) : CoreHarness(options) {}
  void SetUp() override {
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(Register(r).ok());
  }

  absl::Status Register(int rank) {
    v1::RegisterRequest req;
    req.set_job_id("job");
    req.set_wire_revision(shardcoord::kWireRevision);
    req.set_rank(rank);
    req.set_world_size(2);
    req.set_group_size(2);
    req.set_policy(v1::POLICY_AUTO);
    req.set_fallback(v1::FALLBACK_ROOT);
    req.set_wrap_outer_model(true);
    auto* m = req.add_modules();
    m->set_name("visual");
    m->set_param_bytes(100);
    return CoreHarness::Register(req);
  }

  // The rank's session key (from its RegisterResponse): communicator calls carry it.
  std::string Key(int rank) {
    std::string key;
    for (const auto& m : sinks_[rank]->messages) {
      if (m.has_registered()) key = m.registered().session_key();
    }
    return key;
  }

  CommCallerId Caller(int rank) { return {"job", rank, Key(rank)}; }

  // A join of communicator `name` by `rank`, from its session.
  CommJoinCall JoinRequest(int rank, const std::string& name, int timeout_ms = 5000) {
    return {Caller(rank), name, {}, absl::Milliseconds(timeout_ms)};
  }

  // A store call of `rank`'s own session for communicator "world".
  StoreSetCall SetRequest(int rank, int64_t epoch, const std::string& key, const std::string& value) {
    return {Caller(rank), "world", epoch, key, value};
  }
  StoreGetCall GetRequest(int rank, int64_t epoch, const std::vector<std::string>& keys, int timeout_ms) {
    return {Caller(rank), "world", epoch, keys, absl::Milliseconds(timeout_ms)};
  }

  // The core's answer to `call`, if it gave one at once.
  std::optional<absl::StatusOr<CommMembership>> JoinNow(const CommJoinCall& call) {
    std::optional<absl::StatusOr<CommMembership>> out;
    core_->CommJoin(call, [&out](absl::StatusOr<CommMembership> r) { out = std::move(r); });
    return out;
  }

  // Joins "world"; the answer lands in *out when the core gives it.
  void Join(int rank, std::optional<absl::StatusOr<CommMembership>>* out, int timeout_ms = 5000) {
    core_->CommJoin(JoinRequest(rank, "world", timeout_ms),
                    [out](absl::StatusOr<CommMembership> r) { *out = std::move(r); });
  }

  absl::Status Report(int rank, int64_t epoch, CommReportKind kind, const std::string& error = "") {
    return core_->CommReport({Caller(rank), "world", epoch, kind, error});
  }

  v1::CommStatus World() {
    const v1::ListCommsResponse all = core_->Comms("job");  // Kept alive while iterating.
    for (const auto& c : all.comms()) {
      if (c.name() == "world") return c;
    }
    return {};
  }

  // Both ranks join and report ready: epoch `epoch` is READY.
  void FormEpoch(int64_t epoch) {
    std::optional<absl::StatusOr<CommMembership>> j0, j1;
    Join(0, &j0);
    Join(1, &j1);
    ASSERT_TRUE(j0 && j0->ok() && j1 && j1->ok());
    ASSERT_EQ((*j0)->epoch, epoch);
    ASSERT_TRUE(Report(0, epoch, CommReportKind::kReady).ok());
    ASSERT_TRUE(Report(1, epoch, CommReportKind::kReady).ok());
    ASSERT_EQ(World().state(), v1::COMM_STATE_READY);
  }

};

TEST_F(CommManagerTest, AnEpochStartsOnceEveryMemberIsLiveAndIsReadyOnceEveryMemberConnected) {
  std::optional<absl::StatusOr<CommMembership>> j0, j1;
  Join(0, &j0);  // Both ranks are live: epoch 1 starts at once.
  ASSERT_TRUE(j0 && j0->ok());
  EXPECT_EQ((*j0)->epoch, 1);
  EXPECT_THAT(std::vector<int>((*j0)->ranks.begin(), (*j0)->ranks.end()), ::testing::ElementsAre(0, 1));
  Join(1, &j1);
  ASSERT_TRUE(j1 && j1->ok());
  EXPECT_EQ((*j1)->epoch, 1) << "joins the current epoch";
  EXPECT_EQ(World().state(), v1::COMM_STATE_FORMING);
  ASSERT_TRUE(Report(0, 1, CommReportKind::kReady).ok());
  EXPECT_EQ(World().state(), v1::COMM_STATE_FORMING) << "until every member is ready";
  ASSERT_TRUE(Report(1, 1, CommReportKind::kReady).ok());
  EXPECT_EQ(World().state(), v1::COMM_STATE_READY);
  EXPECT_EQ(Report(1, 2, CommReportKind::kReady).code(), absl::StatusCode::kFailedPrecondition)
      << "a report for an epoch that does not exist";
  absl::Status old_ack = Report(0, 1, static_cast<CommReportKind>(3));
  EXPECT_EQ(old_ack.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(old_ack.message(), HasSubstr("acknowledged on the session stream"));
}

TEST_F(CommManagerTest, TheEpochStoreAnswersOnceTheKeyIsSet) {
  FormEpoch(1);
  std::optional<absl::StatusOr<std::vector<std::string>>> got;
  StoreGetCall get = GetRequest(1, 1, {"nccl_id"}, 5000);
  core_->StoreGet(get, [&](absl::StatusOr<std::vector<std::string>> r) { got = std::move(r); });
  EXPECT_FALSE(got.has_value());
  StoreSetCall set = SetRequest(0, 1, "nccl_id", "bytes");
  ASSERT_TRUE(core_->StoreSet(set).ok());
  ASSERT_TRUE(got && got->ok());
  ASSERT_EQ((*got)->size(), 1);
  EXPECT_EQ((**got)[0], "bytes");
  EXPECT_EQ(core_->StoreSet(set).code(), absl::StatusCode::kAlreadyExists) << "a key is published once";
}

TEST_F(CommManagerTest, ADeathAbortsTheEpochAndTheNextFormsAfterEveryAckAndReturn) {
  FormEpoch(1);
  core_->OnSessionClosed(sessions_[1], "killed");
  auto aborts = sinks_[0]->Where([](const auto& m) { return m.has_comm_abort(); });
  ASSERT_EQ(aborts.size(), 1u);
  EXPECT_EQ(aborts[0].comm_abort().epoch(), 1);
  EXPECT_THAT(aborts[0].comm_abort().reason(), HasSubstr("rank 1"));
  EXPECT_THAT(std::vector<int>(aborts[0].comm_abort().lost_ranks().begin(), aborts[0].comm_abort().lost_ranks().end()),
              ::testing::ElementsAre(1));
  EXPECT_EQ(World().state(), v1::COMM_STATE_ABORTING);
  v1::CommAborted ack;
  ack.set_name("world");
  ack.set_epoch(1);
  OnCommAborted(sessions_[0], ack);
  EXPECT_EQ(World().state(), v1::COMM_STATE_ABORTED);
  EXPECT_EQ(World().epochs_aborted(), 1);

  std::optional<absl::StatusOr<CommMembership>> j0, j1;
  Join(0, &j0);
  EXPECT_FALSE(j0.has_value()) << "rank 1 is not live: no epoch 2 yet";
  ASSERT_TRUE(Register(1).ok());
  Join(1, &j1);
  ASSERT_TRUE(j0 && j0->ok()) << (j0 ? j0->status().ToString() : "no answer");
  EXPECT_EQ((*j0)->epoch, 2);
  EXPECT_THAT((*j0)->previous_abort_reason, HasSubstr("rank 1"));
}

TEST_F(CommManagerTest, AReportedErrorAbortsEveryMember) {
  FormEpoch(1);
  ASSERT_TRUE(Report(1, 1, CommReportKind::kError, "ncclAllReduce: unhandled cuda error").ok());
  for (int r : {0, 1}) {
    auto aborts = sinks_[r]->Where([](const auto& m) { return m.has_comm_abort(); });
    ASSERT_EQ(aborts.size(), 1u) << "rank " << r;
    EXPECT_THAT(aborts[0].comm_abort().reason(), HasSubstr("rank 1 reported a communicator error: ncclAllReduce"));
  }
  EXPECT_EQ(Report(0, 1, CommReportKind::kReady).code(), absl::StatusCode::kAborted)
      << "the epoch is over: reports for it are refused, naming why";
}

TEST_F(CommManagerTest, AJoinThatCannotCompleteFailsAtItsDeadlineNamingTheMissingRank) {
  core_->OnSessionClosed(sessions_[1], "killed");
  std::optional<absl::StatusOr<CommMembership>> j0;
  Join(0, &j0, /*timeout_ms=*/200);
  core_->Tick();
  EXPECT_FALSE(j0.has_value());
  clock_->Advance(absl::Milliseconds(250));
  OnHeartbeat(sessions_[0]);
  core_->Tick();
  ASSERT_TRUE(j0.has_value());
  EXPECT_EQ(j0->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(j0->status().message(), HasSubstr("rank 1 dead (rank 1: session stream lost (killed))"));
}

TEST_F(CommManagerTest, BadCallsFromTheRankItselfAreRefusedNamingWhatIsWrong) {
  CommJoinCall join = JoinRequest(0, "group/1", /*timeout_ms=*/100);
  auto j = JoinNow(join);
  ASSERT_TRUE(j.has_value());
  EXPECT_EQ(j->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(j->status().message(), HasSubstr("has groups 0..0"));
  join.name = "custom";
  join.ranks.push_back(0);
  join.ranks.push_back(9);
  j = JoinNow(join);
  ASSERT_TRUE(j.has_value());
  EXPECT_EQ(j->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(j->status().message(), HasSubstr("in 0..1"));
  FormEpoch(1);
  StoreSetCall set = SetRequest(0, 7, "k", "v");
  absl::Status s = core_->StoreSet(set);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("wrong epoch 7"));
  set.epoch = 1;
  ASSERT_TRUE(core_->StoreSet(set).ok());
  std::optional<absl::StatusOr<std::vector<std::string>>> got;
  StoreGetCall get = GetRequest(1, 1, {"k", "never"}, 100);
  core_->StoreGet(get, [&](absl::StatusOr<std::vector<std::string>> r) { got = std::move(r); });
  EXPECT_FALSE(got.has_value());
  clock_->Advance(absl::Milliseconds(150));
  OnHeartbeat(sessions_[0]);
  OnHeartbeat(sessions_[1]);
  core_->Tick();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got->status().message(), HasSubstr("[never]"));
  get.caller.session_key = Key(0);  // Rank 0's key on rank 1's call.
  got.reset();
  core_->StoreGet(get, [&](absl::StatusOr<std::vector<std::string>> r) { got = std::move(r); });
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(CommManagerTest, NamesKeysAndValuesAreBoundedAndMustBePrintable) {
  CommJoinCall req = JoinRequest(0, "evil\x1b[2J");
  req.ranks.push_back(0);
  auto j = JoinNow(req);
  ASSERT_TRUE(j.has_value());
  EXPECT_EQ(j->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(j->status().message(), HasSubstr("control character"));
  EXPECT_THAT(j->status().message(), HasSubstr("evil\\x1b[2J"));

  FormEpoch(1);
  StoreSetCall set = SetRequest(0, 1, "big", std::string(options_.limits.max_store_value_bytes + 1, 'x'));
  absl::Status s = core_->StoreSet(set);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("max_store_value_bytes"));
  set.value = "v";
  int accepted = 0;
  for (int k = 0; k < 100; ++k) {
    set.key = "key" + std::to_string(k);
    if (core_->StoreSet(set).ok()) accepted++;
  }
  EXPECT_EQ(accepted, 2 * 2 + 16) << "at most 2 x members + 16 keys per epoch";

  CoordinatorOptions o = CommTestOptions();
  o.limits.max_communicators_per_job = 2;
  Reset(o);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(Register(r).ok());
  std::vector<absl::StatusOr<CommMembership>> answers;
  for (const char* name : {"a", "b", "c"}) {
    CommJoinCall c = JoinRequest(0, name);
    c.ranks.push_back(0);
    auto answer = JoinNow(c);
    ASSERT_TRUE(answer.has_value()) << name;
    answers.push_back(*std::move(answer));
  }
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_TRUE(answers[0].ok() && answers[1].ok());
  EXPECT_EQ(answers[2].status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(answers[2].status().message(), HasSubstr("max_communicators_per_job"));
}

TEST_F(CommManagerTest, CompletionsRunAfterTheCoreLockIsReleased) {
  // A completion that calls back into the core (as gRPC's may, on another thread) must not
  // find the core's mutex held: the core defers completions until it unlocks (DESIGN 8).
  // The call back runs on its own thread with a deadline, so a regression fails, not hangs.
  bool reentered = false;
  core_->CommJoin(JoinRequest(0, "world"), [&](absl::StatusOr<CommMembership> r) {
    ASSERT_TRUE(r.ok()) << r.status();
    auto status = std::async(std::launch::async, [&] { return core_->Comms("job"); });
    reentered = status.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  });
  EXPECT_TRUE(reentered) << "the join's completion ran with the core's mutex held";
}

// Communicator stores are charged to the daemon's max_buffered_bytes (the probe: one rank of a
// one-rank job with 1024 communicators held 1152 MiB, nothing refused).
class BoundedStoreTest : public CommManagerTest {
 protected:
  static CoordinatorOptions Bounded() {
    CoordinatorOptions o = CommTestOptions();
    o.limits.max_buffered_bytes = 256 << 10;
    return o;
  }
  BoundedStoreTest() : CommManagerTest(Bounded()) {}
};

TEST_F(BoundedStoreTest, StoresTakeFromTheDaemonsBudgetAndGiveBackWhenTheEpochEnds) {
  const std::string value(64 << 10, 'x');
  int accepted = 0;
  absl::Status refused;
  for (const std::string name : {"a", "b", "c", "d", "e"}) {
    ASSERT_TRUE(JoinNow({Caller(0), name, {0, 1}, absl::Seconds(5)}).has_value());
    absl::Status s = core_->StoreSet({Caller(0), name, 1, "addr", value});
    if (!s.ok()) {
      refused = s;
      break;
    }
    ++accepted;
  }
  EXPECT_EQ(accepted, 3) << "3 x 64 KiB fit a 256 KiB budget, the fourth does not";
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("does not fit the daemon's buffers (max_buffered_bytes 262144"));
  EXPECT_LE(core_->buffers()->used(), core_->buffers()->limit());
  EXPECT_GT(core_->buffers()->used(), 3 * (64 << 10));
  // Rank 1 dies: every epoch it was in is aborted, and their stores give their bytes back.
  core_->OnSessionClosed(sessions_[1], "killed");
  for (const std::string name : {"a", "b", "c", "d"}) {
    v1::CommAborted ack;
    ack.set_name(name);
    ack.set_epoch(1);
    OnCommAborted(sessions_[0], ack);
  }
  EXPECT_LT(core_->buffers()->used(), 64 << 10) << "aborted epochs hold no store";
}

}  // namespace
}  // namespace shardcoord::coordinator
