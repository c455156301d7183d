// CommTable on its own (DESIGN 4), through a fake CommHost: the table's rules without a core,
// a network or a worker. What a member's state is, what is sent to whom, the events and the
// completions run after "unlocking" are all the host's, so each is seen and set directly here.
#include "coordinator/core/comm_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/core/buffer_budget.h"

namespace shardcoord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FakeCommHost final : public CommHost {
 public:
  absl::Time Now() const override { return now; }
  v1::RankState StateOf(int rank) const override {
    auto it = states.find(rank);
    return it == states.end() ? v1::RANK_STATE_UNREGISTERED : it->second;
  }
  std::string DeadReasonOf(int rank) const override { return "killed (rank " + std::to_string(rank) + ")"; }
  void Send(int rank, const v1::CoordinatorMessage& msg) override { sent[rank].push_back(msg); }
  void Event(Severity severity, EventKind kind, int rank, const std::string& message) override {
    events.push_back({severity, kind, rank, message});
  }
  void Defer(std::function<void()> f) override { deferred.push_back(std::move(f)); }
  // What the core does once it releases its lock.
  void Unlock() {
    auto run = std::move(deferred);
    deferred.clear();
    for (auto& f : run) f();
  }
  int Count(EventKind kind) const {
    int n = 0;
    for (const auto& e : events) n += e.kind == kind;
    return n;
  }

  struct Seen {
    Severity severity;
    EventKind kind;
    int rank;
    std::string message;
  };
  absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  std::map<int, v1::RankState> states;
  std::map<int, std::vector<v1::CoordinatorMessage>> sent;
  std::vector<Seen> events;
  std::vector<std::function<void()>> deferred;
};

class CommTableTest : public ::testing::Test {
 protected:
  CommTableTest() : table_("job", 4, 2, CoordinatorLimits{}, absl::Seconds(5), &budget_) {
    for (int r = 0; r < 4; ++r) host_.states[r] = v1::RANK_STATE_LIVE;
  }
  // Joins `name` as `rank`; the answer, once the host has "unlocked" (nullopt: still waiting).
  std::optional<absl::StatusOr<CommMembership>>* Join(int rank, const std::string& name,
                                                      absl::Duration timeout = absl::ZeroDuration()) {
    answers_.emplace_back();
    auto* slot = &answers_.back();
    CommJoinCall call;
    call.caller = {"job", rank, "key"};
    call.name = name;
    call.timeout = timeout;
    JoinCall(call, [slot](absl::StatusOr<CommMembership> m) { *slot = std::move(m); });
    host_.Unlock();
    return slot;
  }
  absl::Status Ready(int rank, const std::string& name, int64_t epoch) {
    CommReportCall call;
    call.caller = {"job", rank, "key"};
    call.name = name;
    call.epoch = epoch;
    call.kind = CommReportKind::kReady;
    CoreLock lock(&held_);
    return table_.Report(host_, held_, call);
  }
  // The table's mutators, each under the lock it requires (the core's, here a mutex of the
  // test's), as the core calls them.
  void JoinCall(const CommJoinCall& call, CommTable::JoinDone done) {
    CoreLock lock(&held_);
    table_.Join(host_, held_, call, std::move(done));
  }
  absl::Status Set(const StoreSetCall& call) {
    CoreLock lock(&held_);
    return table_.Set(host_, held_, call);
  }
  void Get(const StoreGetCall& call, CommTable::GetDone done) {
    CoreLock lock(&held_);
    table_.Get(host_, held_, call, std::move(done));
  }
  void OnRankLost(int rank, const std::string& reason) {
    CoreLock lock(&held_);
    table_.OnRankLost(host_, held_, rank, /*clean=*/false, reason);
  }
  void OnRankBack(int rank) {
    CoreLock lock(&held_);
    table_.OnRankBack(host_, held_, rank);
  }
  void AckAbort(const CommAbortAck& ack, int rank) {
    CoreLock lock(&held_);
    table_.AckAbort(host_, held_, ack, rank);
  }
  void Tick() {
    CoreLock lock(&held_);
    table_.Tick(host_, held_, host_.now);
  }
  v1::CommStatus StatusOf(const std::string& name) const {
    v1::ListCommsResponse out;
    table_.Fill(&out);
    for (const auto& c : out.comms()) {
      if (c.name() == name) return c;
    }
    ADD_FAILURE() << "no communicator " << name;
    return {};
  }

  CoreMutex held_;
  BufferBudget budget_{1 << 20};
  FakeCommHost host_;
  CommTable table_;
  std::deque<std::optional<absl::StatusOr<CommMembership>>> answers_;
};

TEST_F(CommTableTest, AnEpochFormsOnceEveryMemberIsLiveAndIsReadyWhenEveryMemberSaysSo) {
  host_.states[1] = v1::RANK_STATE_UNREGISTERED;
  auto* a0 = Join(0, "group/0");
  EXPECT_FALSE(a0->has_value()) << "rank 1 is not live: rank 0 waits";
  host_.states[1] = v1::RANK_STATE_LIVE;
  OnRankBack(1);
  host_.Unlock();
  ASSERT_TRUE(a0->has_value());
  ASSERT_TRUE((*a0)->ok()) << (*a0)->status();
  EXPECT_EQ((**a0)->epoch, 1);
  EXPECT_THAT((**a0)->ranks, ElementsAre(0, 1));
  auto* a1 = Join(1, "group/0");
  ASSERT_TRUE(a1->has_value() && (*a1)->ok());
  EXPECT_EQ((**a1)->epoch, 1);
  EXPECT_EQ(StatusOf("group/0").state(), v1::COMM_STATE_FORMING);
  ASSERT_TRUE(Ready(0, "group/0", 1).ok());
  EXPECT_EQ(StatusOf("group/0").state(), v1::COMM_STATE_FORMING);
  ASSERT_TRUE(Ready(1, "group/0", 1).ok());
  EXPECT_EQ(StatusOf("group/0").state(), v1::COMM_STATE_READY);
  EXPECT_EQ(host_.Count(EventKind::kCommReady), 1);
  EXPECT_EQ(Ready(0, "group/0", 2).code(), absl::StatusCode::kFailedPrecondition) << "a later epoch than the table's";
}

TEST_F(CommTableTest, ADeathAbortsTheEpochForTheOthersAndTheNextFormsWhenTheReplacementIsLive) {
  Join(0, "group/0");
  Join(1, "group/0");
  ASSERT_TRUE(Ready(0, "group/0", 1).ok() && Ready(1, "group/0", 1).ok());
  host_.states[1] = v1::RANK_STATE_DEAD;
  OnRankLost(1, "rank 1 declared dead: killed");
  host_.Unlock();
  // The survivor is told, the dead rank is not; the epoch waits for no ack from the dead.
  ASSERT_EQ(host_.sent[0].size(), 1u);
  EXPECT_EQ(host_.sent[0][0].comm_abort().epoch(), 1);
  EXPECT_THAT(host_.sent[0][0].comm_abort().lost_ranks(), ElementsAre(1));
  EXPECT_TRUE(host_.sent[1].empty());
  EXPECT_EQ(host_.Count(EventKind::kCommAborted), 1);
  EXPECT_EQ(StatusOf("group/0").state(), v1::COMM_STATE_ABORTING) << "rank 0 has not acknowledged";
  AckAbort(CommAbortAck{"group/0", 1}, 0);
  EXPECT_EQ(StatusOf("group/0").state(), v1::COMM_STATE_ABORTED);
  // Rank 0 joins again: it waits for the replacement of rank 1, then both get epoch 2, told why
  // epoch 1 ended.
  auto* again = Join(0, "group/0");
  EXPECT_FALSE(again->has_value());
  host_.states[1] = v1::RANK_STATE_LIVE;
  OnRankBack(1);
  host_.Unlock();
  ASSERT_TRUE(again->has_value() && (*again)->ok());
  EXPECT_EQ((**again)->epoch, 2);
  EXPECT_THAT((**again)->previous_abort_reason, HasSubstr("rank 1 declared dead"));
}

TEST_F(CommTableTest, AJoinWaitsUntilItsDeadlineAndNamesWhoIsMissingAndWhy) {
  host_.states[1] = v1::RANK_STATE_DEAD;
  auto* a = Join(0, "group/0", absl::Seconds(3));
  EXPECT_FALSE(a->has_value());
  host_.now += absl::Seconds(2);
  Tick();
  host_.Unlock();
  EXPECT_FALSE(a->has_value()) << "before its deadline";
  host_.now += absl::Seconds(2);
  Tick();
  host_.Unlock();
  ASSERT_TRUE(a->has_value());
  EXPECT_EQ((*a)->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT((*a)->status().message(), HasSubstr("rank 1 dead (rank 1: killed (rank 1))"));
}

TEST_F(CommTableTest, TheStoreIsChargedToTheDaemonsBudgetUntilItsEpochEnds) {
  Join(0, "group/0");
  Join(1, "group/0");
  StoreSetCall set;
  set.caller = {"job", 0, "key"};
  set.name = "group/0";
  set.epoch = 1;
  set.key = "nccl-id";
  set.value = std::string(4096, 'x');
  ASSERT_TRUE(Set(set).ok());
  EXPECT_GE(budget_.used(), 4096);
  EXPECT_EQ(Set(set).code(), absl::StatusCode::kAlreadyExists) << "each key once per epoch";
  StoreGetCall get;
  get.caller = {"job", 1, "key"};
  get.name = "group/0";
  get.epoch = 1;
  get.keys = {"nccl-id"};
  std::optional<absl::StatusOr<std::vector<std::string>>> got;
  Get(get, [&](absl::StatusOr<std::vector<std::string>> v) { got = std::move(v); });
  host_.Unlock();
  ASSERT_TRUE(got.has_value() && got->ok());
  EXPECT_EQ((**got)[0].size(), 4096u);
  host_.states[1] = v1::RANK_STATE_DEAD;
  OnRankLost(1, "killed");
  AckAbort(CommAbortAck{"group/0", 1}, 0);
  host_.Unlock();
  EXPECT_EQ(budget_.used(), 0) << "the aborted epoch's store gave its bytes back";
}

TEST_F(CommTableTest, ACustomCommunicatorMustNameItsCallerAndKeepItsMembers) {
  CommJoinCall call;
  call.caller = {"job", 0, "key"};
  call.name = "pair";
  call.ranks = {0, 3};
  std::optional<absl::StatusOr<CommMembership>> first, other;
  JoinCall(call, [&](absl::StatusOr<CommMembership> m) { first = std::move(m); });
  call.caller.rank = 3;
  call.ranks = {1, 3};
  JoinCall(call, [&](absl::StatusOr<CommMembership> m) { other = std::move(m); });
  host_.Unlock();
  ASSERT_TRUE(first.has_value() && first->ok()) << first->status();
  ASSERT_TRUE(other.has_value());
  EXPECT_EQ(other->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other->status().message()), HasSubstr("has ranks [0,3]"));
  EXPECT_THAT(std::string(other->status().message()), HasSubstr("asked for [1,3]"));
}

}  // namespace
}  // namespace shardcoord::coordinator
