// The in-process fixture: the real coordinator server on 127.0.0.1:0 and real workers
// talking to it over loopback. Shared by the integration tests.
#ifndef SHARDCOORD_TESTS_INTEGRATION_INPROCESS_FIXTURE_H_
#define SHARDCOORD_TESTS_INTEGRATION_INPROCESS_FIXTURE_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/server/coordinator_server.h"
#include "shardcoord/worker.h"

namespace shardcoord {

inline constexpr absl::Duration kDecisionTimeout = absl::Seconds(60);
inline const std::vector<std::string> kModules = {"vision_tower", "audio_tower"};

class InProcessTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(); }

  void StartServer(coordinator::CoordinatorOptions o = {}) {
    o.listen_address = "127.0.0.1:0";
    if (o.heartbeat_interval == coordinator::kDefaultHeartbeatInterval) {
      o.heartbeat_interval = absl::Milliseconds(100);
      o.heartbeat_timeout = absl::Milliseconds(2000);
    }
    auto s = coordinator::CoordinatorServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }

  WorkerOptions Options(int rank, int world, int group_size, Policy policy = Policy::kAuto,
                        const std::string& job = "job") {
    WorkerOptions o;
    o.coordinator_address = server_->address();
    o.job_id = job;
    o.rank = rank;
    o.world_size = world;
    o.group_size = group_size;
    for (const auto& name : kModules) o.modules.push_back({name, 4096, {{"layers.0", 2048}, {"layers.1", 2048}}, false});
    o.policy = policy;
    o.fallback = Fallback::kRoot;
    o.lookahead = 4;
    o.connect_timeout = absl::Seconds(10);
    return o;
  }

  std::unique_ptr<Worker> Connect(const WorkerOptions& o) {
    auto w = Worker::Connect(o);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }

  // Both workers open "world" and all-reduce one value each, on two threads; asserts success.
  static void AllReduceOnWorld(Worker& w0, Worker& w1, int64_t* v0, int64_t* v1, ReduceOp op) {
    auto run = [op](Worker& w, int64_t* v) {
      CommunicatorOptions co;
      co.name = "world";
      auto c = w.OpenCommunicator(co);
      return c.ok() ? (*c)->AllReduce(v, 1, op) : c.status();
    };
    absl::Status s0;
    std::thread t0([&] { s0 = run(w0, v0); });
    absl::Status s1 = run(w1, v1);
    t0.join();
    ASSERT_TRUE(s0.ok()) << s0;
    ASSERT_TRUE(s1.ok()) << s1;
  }

  // Both ranks of one group plan (0, mb) with the vision tower called once; each gets the
  // decision, and it is the same one (asserted).
  static void DecideTogether(Worker& w0, Worker& w1, int mb) {
    ASSERT_TRUE(w0.ReportPlan(PlanOf(0, mb, 1)).ok());
    ASSERT_TRUE(w1.ReportPlan(PlanOf(0, mb, 1)).ok());
    auto d0 = w0.GetDecision({0, mb}, kDecisionTimeout);
    auto d1 = w1.GetDecision({0, mb}, kDecisionTimeout);
    ASSERT_TRUE(d0.ok() && d1.ok()) << d0.status() << " " << d1.status();
    EXPECT_EQ(d0->digest, d1->digest);
  }

  static MicrobatchPlan PlanOf(int64_t step, int mb, int vision, int audio = 0) {
    return MicrobatchPlan{{step, mb}, {{"vision_tower", vision}, {"audio_tower", audio}}};
  }

  std::unique_ptr<coordinator::CoordinatorServer> server_;
};

}  // namespace shardcoord

#endif  // SHARDCOORD_TESTS_INTEGRATION_INPROCESS_FIXTURE_H_
