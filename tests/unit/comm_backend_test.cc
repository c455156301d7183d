// Unit tests of the collective backends' connect and abort paths (worker/src/comm_base.h,
// gloo_communicator.cc; DESIGN 4) without gRPC: the members are threads of this process,
// real Gloo over loopback TCP, and the epoch's store is an in-memory EpochRendezvous (the
// seam the coordinator sits behind in production).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "comm_base.h"

namespace shardcoord::internal {
namespace {

using ::testing::HasSubstr;

// What the coordinator keeps for one (communicator, epoch): the store and the reports.
struct MemoryEpoch {
  absl::Mutex mu;
  std::map<std::string, std::string> store ABSL_GUARDED_BY(mu);
  int ready ABSL_GUARDED_BY(mu) = 0;
  std::vector<std::string> errors ABSL_GUARDED_BY(mu);
  std::string abort_reason ABSL_GUARDED_BY(mu);  // Set by the first reported error.
};

class MemoryRendezvous final : public EpochRendezvous {
 public:
  MemoryRendezvous(std::shared_ptr<MemoryEpoch> epoch, int rank) : epoch_(std::move(epoch)), rank_(rank) {}

  absl::Status Publish(const std::string& key, const std::string& value) override {
    absl::MutexLock lock(&epoch_->mu);
    if (!epoch_->store.emplace(key, value).second) return absl::AlreadyExistsError(absl::StrCat("key ", key));
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> Fetch(const std::vector<std::string>& keys,
                                                absl::Duration timeout) override {
    MemoryEpoch& e = *epoch_;
    absl::MutexLock lock(&e.mu);
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu) {
      for (const auto& k : keys) {
        if (!e.store.count(k)) return false;
      }
      return true;
    };
    if (!e.mu.AwaitWithTimeout(absl::Condition(&all), timeout)) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!e.store.count(k)) missing.push_back(k);
      }
      return absl::DeadlineExceededError(absl::StrCat("keys [", absl::StrJoin(missing, ", "), "] were not published"));
    }
    std::vector<std::string> values;
    for (const auto& k : keys) values.push_back(e.store[k]);
    return values;
  }

  absl::Status ReportReady() override {
    absl::MutexLock lock(&epoch_->mu);
    epoch_->ready++;
    return absl::OkStatus();
  }

  absl::Status ReportError(const std::string& error) override {
    absl::MutexLock lock(&epoch_->mu);
    epoch_->errors.push_back(absl::StrCat("rank ", rank_, ": ", error));
    if (!epoch_->abort_reason.empty()) return absl::AbortedError(epoch_->abort_reason);
    epoch_->abort_reason = absl::StrCat("rank ", rank_, " reported a communicator error: ", error);
    return absl::OkStatus();
  }

 private:
  const std::shared_ptr<MemoryEpoch> epoch_;
  const int rank_;
};

class CommBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("SHARDCOORD_GLOO_HOST", "127.0.0.1", 1);
    // As Worker::Connect does in a trainer (worker.cc, IgnoreSigpipeOnce): these tests make
    // communicators without a Worker, and a write to a socket an aborted peer closed must
    // fail that write, not kill the process (seen once in CI: SIGPIPE in the abort test).
    signal(SIGPIPE, SIG_IGN);
  }

  // Member `rank` of a Gloo communicator over `ranks`, sharing `epoch_`.
  std::shared_ptr<AbortableCommunicator> Member(int rank, std::vector<int> ranks, CommunicatorOptions options = {}) {
    options.name = "world";
    CommSpec spec{"job", rank, "world", 1, std::move(ranks), options};
    return MakeGlooCommunicator(std::make_shared<MemoryRendezvous>(epoch_, rank), std::move(spec));
  }

  // Connects every member, each on its own thread, within a deadline.
  void ConnectAll(const std::vector<std::shared_ptr<AbortableCommunicator>>& members) {
    std::vector<std::future<absl::Status>> connected;
    for (const auto& m : members) connected.push_back(std::async(std::launch::async, [m] { return m->Connect(); }));
    for (auto& c : connected) {
      ASSERT_EQ(c.wait_for(std::chrono::seconds(60)), std::future_status::ready) << "Connect did not return";
      ASSERT_TRUE(c.get().ok());
    }
  }

  std::shared_ptr<MemoryEpoch> epoch_ = std::make_shared<MemoryEpoch>();
};

TEST_F(CommBackendTest, MembersConnectThroughTheEpochStoreAndRunEveryCollective) {
  const std::vector<int> ranks = {0, 2, 5};  // Job ranks; indexes 0, 1, 2.
  std::vector<std::shared_ptr<AbortableCommunicator>> members;
  for (int r : ranks) members.push_back(Member(r, ranks));
  EXPECT_EQ(members[1]->rank(), 1);
  EXPECT_EQ(members[2]->size(), 3);
  EXPECT_EQ(members[0]->Health().code(), absl::StatusCode::kFailedPrecondition) << "not connected yet";
  ConnectAll(members);
  {
    absl::MutexLock lock(&epoch_->mu);
    EXPECT_EQ(epoch_->ready, 3) << "each member reports ready once connected";
  }
  std::vector<std::future<std::vector<float>>> results;
  for (int i = 0; i < 3; ++i) {
    results.push_back(std::async(std::launch::async, [&, i] {
      auto& c = *members[i];
      std::vector<float> sum = {float(i), 1.0f};
      EXPECT_TRUE(c.AllReduce(sum.data(), sum.size()).ok());
      float mine = 10.0f * i;
      std::vector<float> gathered(3);
      EXPECT_TRUE(c.AllGather(&mine, gathered.data(), 1).ok());
      float from_root = i == 2 ? 7.0f : 0.0f;
      EXPECT_TRUE(c.Broadcast(&from_root, 1, DataType::kFloat32, /*root=*/2).ok());
      EXPECT_TRUE(c.Barrier().ok());
      std::vector<float> out = sum;
      out.insert(out.end(), gathered.begin(), gathered.end());
      out.push_back(from_root);
      return out;
    }));
  }
  for (auto& r : results) {
    ASSERT_EQ(r.wait_for(std::chrono::seconds(60)), std::future_status::ready);
    EXPECT_THAT(r.get(), ::testing::ElementsAre(3.0f, 3.0f, 0.0f, 10.0f, 20.0f, 7.0f));
  }
  int64_t issued = 0, completed = 0;
  members[0]->Progress(&issued, &completed);
  EXPECT_EQ(issued, 4);
  EXPECT_EQ(completed, 4);
  EXPECT_TRUE(members[0]->Health().ok());
}

TEST_F(CommBackendTest, AnAbortEndsAWaitingCollectiveAndThePeerReportsItsFailure) {
  CommunicatorOptions options;
  options.op_timeout = absl::Seconds(120);  // Far beyond the test's deadline: only the abort can end the wait.
  auto a = Member(0, {0, 1}, options);
  auto b = Member(1, {0, 1}, options);
  ConnectAll({a, b});
  // Rank 0 waits in an all-reduce that rank 1 never joins.
  auto waiting = std::async(std::launch::async, [a] {
    float x = 1.0f;
    return a->AllReduce(&x, 1);
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  int64_t issued = 0, completed = 0;
  while (issued == 0 && absl::Now() < deadline) {  // Until the collective started.
    a->Progress(&issued, &completed);
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(issued, 1);
  a->Abort("rank 7 was declared dead");
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(30)), std::future_status::ready) << "the abort did not end the wait";
  absl::Status s = waiting.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("rank 7 was declared dead"));
  EXPECT_THAT(s.message(), HasSubstr("open it again"));
  EXPECT_EQ(a->Health().code(), absl::StatusCode::kAborted);
  float y = 0;
  EXPECT_EQ(a->Barrier().code(), absl::StatusCode::kAborted) << "later collectives fail at once";
  EXPECT_EQ(a->AllReduce(&y, 1).code(), absl::StatusCode::kAborted);

  // Rank 0's abandoned all-reduce still runs in the background: rank 1's all-reduce meets
  // it and completes. Its end closes rank 0's connections (the abort came meanwhile), so
  // rank 1's next collective fails; with no verdict from the coordinator here, rank 1
  // reports the error itself and aborts with it.
  float x = 1.0f;
  auto matched = std::async(std::launch::async, [b, &x] { return b->AllReduce(&x, 1); });
  ASSERT_EQ(matched.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_TRUE(matched.get().ok());
  EXPECT_EQ(x, 2.0f);
  auto failed = std::async(std::launch::async, [b] { return b->Barrier(); });
  ASSERT_EQ(failed.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  absl::Status ps = failed.get();
  EXPECT_EQ(ps.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(ps.message(), HasSubstr("barrier failed"));
  absl::MutexLock lock(&epoch_->mu);
  ASSERT_EQ(epoch_->errors.size(), 1u);
  EXPECT_THAT(epoch_->errors[0], HasSubstr("rank 1: barrier failed"));
}

TEST_F(CommBackendTest, AFailureAfterTheCoordinatorsAbortCarriesItsVerdict) {
  auto a = Member(0, {0, 1});
  auto b = Member(1, {0, 1});
  ConnectAll({a, b});
  {
    // The coordinator already aborted the epoch: it saw rank 0's session end.
    absl::MutexLock lock(&epoch_->mu);
    epoch_->abort_reason = "rank 0 was declared dead: its session ended";
  }
  a.reset();  // Rank 0 is gone: its sockets close.
  float x = 1.0f;
  auto failed = std::async(std::launch::async, [b, &x] { return b->AllReduce(&x, 1); });
  ASSERT_EQ(failed.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  absl::Status s = failed.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("rank 0 was declared dead")) << "the coordinator's verdict names the cause";
  EXPECT_THAT(b->Health().message(), HasSubstr("rank 0 was declared dead"));
}

TEST_F(CommBackendTest, AConnectWhosePeerNeverComesFailsAtTheJoinTimeoutNamingTheKey) {
  CommunicatorOptions options;
  options.join_timeout = absl::Milliseconds(300);
  auto a = Member(0, {0, 1}, options);
  auto connected = std::async(std::launch::async, [a] { return a->Connect(); });
  ASSERT_EQ(connected.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  absl::Status s = connected.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("were not published"));
  EXPECT_EQ(a->Health().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace shardcoord::internal
