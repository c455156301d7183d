// In-process integration tests: the real coordinator server on 127.0.0.1:0 and real
// workers (and raw gRPC clients, for bad input) talking to it over loopback.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "absl/synchronization/notification.h"
#include "coordinator/server/auth.h"
#include "coordinator/server/coordinator_server.h"
#include "google/protobuf/unknown_field_set.h"
#include "integration/inprocess_fixture.h"
#include "shardcoord/decide.h"
#include "shardcoord/plan_ahead.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"
#include "shardcoord/worker.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

using ::testing::HasSubstr;

// A raw session, for what the worker library would never send.
struct RawSession {
  explicit RawSession(const std::string& address, int deadline_s = 20) {
    stub = v1::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
    stream = stub->Session(&ctx);
  }
  // Sends `req`; returns the RegisterResponse, or the status the stream ended with.
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& req) {
    v1::WorkerMessage m;
    *m.mutable_register_() = req;
    stream->Write(m);
    v1::CoordinatorMessage in;
    if (stream->Read(&in) && in.has_registered()) return in.registered();
    stream->WritesDone();
    return FromGrpcStatus(stream->Finish());
  }
  void SendPlan(const v1::MicrobatchPlan& p, int64_t epoch = 0) {
    v1::WorkerMessage m;
    m.mutable_bundle()->mutable_plans()->set_epoch(epoch);
    *m.mutable_bundle()->mutable_plans()->add_plans() = p;
    stream->Write(m);
  }
  // Next message of the given kind, skipping others; nullopt when the stream ends.
  std::optional<v1::CoordinatorMessage> Next(v1::CoordinatorMessage::KindCase kind) {
    v1::CoordinatorMessage in;
    while (stream->Read(&in)) {
      if (in.kind_case() == kind) return in;
    }
    return std::nullopt;
  }

  std::unique_ptr<v1::Coordinator::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream;
};

v1::RegisterRequest RawRequest(int rank, int world, int group_size) {
  v1::RegisterRequest r;
  r.set_job_id("job");
  r.set_wire_revision(shardcoord::kWireRevision);
  r.set_rank(rank);
  r.set_world_size(world);
  r.set_group_size(group_size);
  r.set_policy(v1::POLICY_AUTO);
  r.set_fallback(v1::FALLBACK_ROOT);
  r.set_wrap_outer_model(true);
  r.set_lookahead(4);
  for (const auto& name : kModules) {
    auto* m = r.add_modules();
    m->set_name(name);
    m->set_param_bytes(4096);
    auto* u0 = m->add_units();
    u0->set_name("layers.0");
    u0->set_param_bytes(2048);
    auto* u1 = m->add_units();
    u1->set_name("layers.1");
    u1->set_param_bytes(2048);
  }
  return r;
}

v1::MicrobatchPlan RawPlan(int64_t step, int mb, const std::string& module, int calls) {
  v1::MicrobatchPlan p;
  p.mutable_key()->set_step(step);
  p.mutable_key()->set_microbatch(mb);
  (*p.mutable_calls())[module] = calls;
  return p;
}

// ---------------------------------------------------------------------------------------

TEST_F(InProcessTest, EveryRankOfAGroupGetsTheIdenticalCorrectDecision) {
  constexpr int kWorld = 8, kGroup = 4, kSteps = 15, kMicro = 4;
  // Random plans, seeded: plans[rank][i] = (vision calls, audio calls).
  std::mt19937 rng(12345);
  std::vector<std::vector<std::pair<int, int>>> plans(kWorld);
  for (int i = 0; i < kSteps * kMicro; ++i) {
    for (int g = 0; g < kWorld / kGroup; ++g) {
      int mode = rng() % 3;  // 0: uniform images, 1: text only, 2: mixed
      for (int r = g * kGroup; r < (g + 1) * kGroup; ++r) {
        int vision = mode == 0 ? 1 : mode == 1 ? 0 : static_cast<int>(rng() % 3);
        plans[r].push_back({vision, static_cast<int>(rng() % 2)});
      }
    }
  }
  std::vector<std::vector<MicrobatchDecision>> got(kWorld);
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto w = Worker::Connect(Options(r, kWorld, kGroup));
      if (!w.ok()) {
        errors[r] = w.status().ToString();
        return;
      }
      size_t reported = 0;
      for (size_t i = 0; i < plans[r].size(); ++i) {
        while (reported < plans[r].size() && reported < i + 4) {
          MicrobatchKey k{static_cast<int64_t>(reported / kMicro), static_cast<int32_t>(reported % kMicro)};
          absl::Status s = (*w)->ReportPlan(PlanOf(k.step, k.microbatch, plans[r][reported].first,
                                                   plans[r][reported].second));
          if (!s.ok()) {
            errors[r] = s.ToString();
            return;
          }
          ++reported;
        }
        auto d = (*w)->GetDecision({static_cast<int64_t>(i / kMicro), static_cast<int32_t>(i % kMicro)},
                                   kDecisionTimeout);
        if (!d.ok()) {
          errors[r] = d.status().ToString();
          return;
        }
        got[r].push_back(*d);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;

  for (int r = 0; r < kWorld; ++r) {
    const int first = (r / kGroup) * kGroup;
    ASSERT_EQ(got[r].size(), plans[r].size());
    for (size_t i = 0; i < got[r].size(); ++i) {
      const MicrobatchDecision& d = got[r][i];
      // Identical to the group's first rank, digest included.
      EXPECT_EQ(d.digest, got[first][i].digest) << "rank " << r << " microbatch " << i;
      EXPECT_EQ(d.seq, i);
      EXPECT_EQ(d.digest, DecisionDigest(d));
      // And correct: the contract applied to what every member planned.
      std::vector<int32_t> vision, audio;
      for (int m = first; m < first + kGroup; ++m) {
        vision.push_back(plans[m][i].first);
        audio.push_back(plans[m][i].second);
      }
      EXPECT_EQ(d.Find("vision_tower")->decision, ApplyContract(Policy::kAuto, Fallback::kRoot, vision).decision);
      EXPECT_EQ(d.Find("audio_tower")->decision, ApplyContract(Policy::kAuto, Fallback::kRoot, audio).decision);
    }
  }
}

TEST_F(InProcessTest, WithLookaheadTheDecisionIsAlreadyLocal) {
  auto w0 = Connect(Options(0, 2, 2));
  auto w1 = Connect(Options(1, 2, 2));
  ASSERT_TRUE(w0 && w1);
  for (int mb = 0; mb < 4; ++mb) ASSERT_TRUE(w0->ReportPlan(PlanOf(0, mb, 1)).ok());
  // Rank 1 has not planned, so nothing can be decided: w0's window is full, and a fifth
  // plan is refused locally, with the coordinator's code.
  absl::Status full = w0->ReportPlan(PlanOf(0, 4, 1));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("lookahead window"));
  EXPECT_EQ(w0->UndecidedPlans(), 4) << "nothing can be decided before rank 1 plans";
  for (int mb = 0; mb < 4; ++mb) ASSERT_TRUE(w1->ReportPlan(PlanOf(0, mb, mb % 2)).ok());
  // Wait for the last one; the earlier ones are then already local: zero timeout works.
  ASSERT_TRUE(w0->GetDecision({0, 3}, kDecisionTimeout).ok());
  ASSERT_TRUE(w1->GetDecision({0, 3}, kDecisionTimeout).ok());
  auto d = w1->GetDecision({0, 3}, absl::ZeroDuration());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << "already taken";
  // Taking (0,3) dropped the older ones: asking for them is an error, not a hang.
  EXPECT_EQ(w1->GetDecision({0, 0}, absl::ZeroDuration()).status().code(), absl::StatusCode::kFailedPrecondition);
  // A fresh pair, without waiting: decisions 0..3 are pops from the local queue.
  for (int mb = 4; mb < 8; ++mb) {
    ASSERT_TRUE(w0->ReportPlan(PlanOf(0, mb, 1)).ok());
    ASSERT_TRUE(w1->ReportPlan(PlanOf(0, mb, 1)).ok());
  }
  ASSERT_TRUE(w0->GetDecision({0, 7}, kDecisionTimeout).ok());
  ASSERT_TRUE(w1->GetDecision({0, 7}, kDecisionTimeout).ok());
}

TEST_F(InProcessTest, StaticPoliciesNeverWaitForTheGroup) {
  for (Policy policy : {Policy::kRoot, Policy::kReplicate}) {
    const std::string job = std::string("static-") + PolicyName(policy);
    auto w = Connect(Options(0, 4, 4, policy, job));  // Ranks 1-3 never come.
    ASSERT_TRUE(w);
    for (int mb = 0; mb < 3; ++mb) ASSERT_TRUE(w->ReportPlan(PlanOf(0, mb, mb % 2)).ok());
    for (int mb = 0; mb < 3; ++mb) {
      auto d = w->GetDecision({0, mb}, kDecisionTimeout);
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(d->Find("vision_tower")->decision,
                policy == Policy::kRoot ? Decision::kRoot : Decision::kReplicate);
      EXPECT_EQ(d->seq, static_cast<uint64_t>(mb));
    }
  }
}

TEST_F(InProcessTest, OneSlowGroupDoesNotDelayAnother) {
  auto a0 = Connect(Options(0, 4, 2));
  auto a1 = Connect(Options(1, 4, 2));  // Group 0's rank 1 never plans.
  auto b0 = Connect(Options(2, 4, 2));
  auto b1 = Connect(Options(3, 4, 2));
  ASSERT_TRUE(a0 && a1 && b0 && b1);
  ASSERT_TRUE(a0->ReportPlan(PlanOf(0, 0, 1)).ok());
  for (int mb = 0; mb < 20; ++mb) {
    ASSERT_TRUE(b0->ReportPlan(PlanOf(0, mb, 1)).ok());
    ASSERT_TRUE(b1->ReportPlan(PlanOf(0, mb, 1)).ok());
    ASSERT_TRUE(b0->GetDecision({0, mb}, kDecisionTimeout).ok());
    ASSERT_TRUE(b1->GetDecision({0, mb}, kDecisionTimeout).ok());
  }
  // Group 0 is still waiting for rank 1, and says so when the deadline passes.
  auto d = a0->GetDecision({0, 0}, absl::Milliseconds(50));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(d.status().message(), HasSubstr("has not reported its plan yet"));
}

TEST_F(InProcessTest, RegistrationErrorsReachTheWorkerWithTheCoordinatorsCode) {
  auto w0 = Connect(Options(0, 4, 2));
  ASSERT_TRUE(w0);
  auto mismatch = Worker::Connect(Options(1, 8, 2));
  ASSERT_FALSE(mismatch.ok());
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(mismatch.status().message(), HasSubstr("world size mismatch"));
  auto dup = Worker::Connect(Options(0, 4, 2));
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  auto unknown = Worker::Connect(Options(7, 4, 2));
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("unknown rank 7"));
  WorkerOptions bad_manifest = Options(1, 4, 2);
  bad_manifest.modules.pop_back();
  auto manifest = Worker::Connect(bad_manifest);
  ASSERT_FALSE(manifest.ok());
  EXPECT_EQ(manifest.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(manifest.status().message(), HasSubstr("module manifest mismatch"));
  // The first rank was not disturbed.
  EXPECT_TRUE(w0->Health().ok());
}

TEST_F(InProcessTest, BadPlansOverTheWireGetPreciseCodesAndOthersAreStillServed) {
  auto w0 = Connect(Options(0, 2, 2));
  ASSERT_TRUE(w0);
  RawSession raw(server_->address());
  ASSERT_TRUE(raw.Register(RawRequest(1, 2, 2)).ok());

  // A good microbatch first: decided for both.
  ASSERT_TRUE(w0->ReportPlan(PlanOf(0, 0, 1)).ok());
  raw.SendPlan(RawPlan(0, 0, "vision_tower", 1));
  auto first = raw.Next(v1::CoordinatorMessage::kDecisions);
  ASSERT_TRUE(first.has_value());
  auto d0 = w0->GetDecision({0, 0}, kDecisionTimeout);
  ASSERT_TRUE(d0.ok());
  EXPECT_EQ(d0->digest, first->decisions().decisions(0).digest());

  struct Case {
    v1::MicrobatchPlan plan;
    absl::StatusCode code;
    std::string text;
  };
  std::vector<Case> cases = {
      {RawPlan(-1, 0, "vision_tower", 1), absl::StatusCode::kInvalidArgument, "must be >= 0"},
      {RawPlan(0, 1, "vison_tower", 1), absl::StatusCode::kInvalidArgument, "unknown module 'vison_tower'"},
      {RawPlan(0, 1, "vision_tower", -3), absl::StatusCode::kInvalidArgument, "calls must be >= 0"},
      {RawPlan(0, 0, "vision_tower", 1), absl::StatusCode::kFailedPrecondition, "out-of-order plan (0,0)"},
  };
  for (const auto& c : cases) {
    raw.SendPlan(c.plan);
    auto rej = raw.Next(v1::CoordinatorMessage::kPlanRejected);
    ASSERT_TRUE(rej.has_value());
    EXPECT_EQ(rej->plan_rejected().code(), static_cast<int>(c.code)) << rej->plan_rejected().message();
    EXPECT_THAT(rej->plan_rejected().message(), HasSubstr(c.text));
    EXPECT_THAT(rej->plan_rejected().message(), HasSubstr("rank 1"));
  }
  // Beyond the window: four plans (0,1..4) are fine, the fifth is not (w0 is silent).
  for (int mb = 1; mb <= 4; ++mb) raw.SendPlan(RawPlan(0, mb, "vision_tower", 0));
  raw.SendPlan(RawPlan(0, 5, "vision_tower", 0));
  auto rej = raw.Next(v1::CoordinatorMessage::kPlanRejected);
  ASSERT_TRUE(rej.has_value());
  EXPECT_EQ(rej->plan_rejected().code(), static_cast<int>(absl::StatusCode::kResourceExhausted));

  // The worker rank is still served, and the decisions match.
  for (int mb = 1; mb <= 4; ++mb) ASSERT_TRUE(w0->ReportPlan(PlanOf(0, mb, 0)).ok());
  auto d4 = w0->GetDecision({0, 4}, kDecisionTimeout);
  ASSERT_TRUE(d4.ok()) << d4.status();
  EXPECT_EQ(d4->Find("vision_tower")->decision, Decision::kSkip);
  EXPECT_EQ(d4->seq, 4u);
}

TEST_F(InProcessTest, SessionMustStartWithRegister) {
  RawSession raw(server_->address());
  raw.SendPlan(RawPlan(0, 0, "vision_tower", 1));
  raw.stream->WritesDone();
  v1::CoordinatorMessage in;
  EXPECT_FALSE(raw.stream->Read(&in));
  grpc::Status st = raw.stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("first message"));
}

TEST_F(InProcessTest, DeadPeerFailsTheGroupInsteadOfHanging) {
  auto w0 = Connect(Options(0, 2, 2));
  ASSERT_TRUE(w0);
  auto raw = std::make_unique<RawSession>(server_->address());
  ASSERT_TRUE(raw->Register(RawRequest(1, 2, 2)).ok());
  ASSERT_TRUE(w0->ReportPlan(PlanOf(0, 0, 1)).ok());
  raw->ctx.TryCancel();  // The peer's connection dies mid-run.
  const absl::Time start = absl::Now();
  auto d = w0->GetDecision({0, 0}, kDecisionTimeout);
  EXPECT_LT(absl::Now() - start, testing::kLoadSlack) << "must fail fast, not wait for the deadline";
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(d.status().message(), HasSubstr("rank 1 declared dead"));
  EXPECT_EQ(w0->ReportPlan(PlanOf(0, 1, 1)).code(), absl::StatusCode::kAborted);

  // The rank comes back: the group re-forms under a new epoch and decides again.
  raw = std::make_unique<RawSession>(server_->address());
  auto resp = raw->Register(RawRequest(1, 2, 2));
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->epoch(), 1);
  ASSERT_TRUE(w0->AwaitGroupReady(kDecisionTimeout).ok());
  EXPECT_EQ(w0->group().epoch, 1);
  // Keys start afresh in the new epoch: the survivor re-plans (0,0), as after a restore.
  ASSERT_TRUE(w0->ReportPlan(PlanOf(0, 0, 1)).ok());
  raw->SendPlan(RawPlan(0, 0, "vision_tower", 1), /*epoch=*/1);
  auto d2 = w0->GetDecision({0, 0}, kDecisionTimeout);
  ASSERT_TRUE(d2.ok()) << d2.status();
  EXPECT_EQ(d2->epoch, 1);
  EXPECT_EQ(d2->Find("vision_tower")->decision, Decision::kPerLayer);
}

TEST_F(InProcessTest, ARankLostInAnotherGroupShowsInJobHealthOnly) {
  // Groups {0, 1} and {2, 3}: rank 3 dies. Rank 0's group is fine (Health OK, decisions go
  // on), but a collective over the world would wait for rank 3: JobHealth names it.
  auto w0 = Connect(Options(0, 4, 2));
  ASSERT_TRUE(w0);
  std::vector<std::unique_ptr<RawSession>> raws;
  for (int r = 1; r < 4; ++r) {
    raws.push_back(std::make_unique<RawSession>(server_->address()));
    ASSERT_TRUE(raws.back()->Register(RawRequest(r, 4, 2)).ok());
  }
  EXPECT_TRUE(w0->JobHealth().ok());
  raws[2]->ctx.TryCancel();  // Rank 3.
  const absl::Time deadline = absl::Now() + testing::kLoadSlack;
  absl::Status job = w0->JobHealth();
  while (job.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    job = w0->JobHealth();
  }
  EXPECT_EQ(job.code(), absl::StatusCode::kAborted) << job;
  EXPECT_THAT(job.message(), HasSubstr("rank 3 of another shard group"));
  EXPECT_THAT(job.message(), HasSubstr("rank 3 declared dead"));
  EXPECT_TRUE(w0->Health().ok()) << "its own group is unaffected";
  ASSERT_TRUE(w0->ReportPlan(PlanOf(0, 0, 1)).ok());
  raws[0]->SendPlan(RawPlan(0, 0, "vision_tower", 1), /*epoch=*/0);
  auto d = w0->GetDecision({0, 0}, kDecisionTimeout);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->Find("vision_tower")->decision, Decision::kPerLayer);
}

TEST_F(InProcessTest, WithoutReconnectCoordinatorLossFailsPendingCallsQuickly) {
  WorkerOptions o = Options(0, 2, 2);
  o.reconnect_window = absl::ZeroDuration();
  auto w0 = Connect(o);
  ASSERT_TRUE(w0);
  ASSERT_TRUE(w0->ReportPlan(PlanOf(0, 0, 1)).ok());
  std::thread stopper([&] { server_->Shutdown(absl::Milliseconds(100)); });
  const absl::Time start = absl::Now();
  auto d = w0->GetDecision({0, 0}, kDecisionTimeout);
  stopper.join();
  EXPECT_LT(absl::Now() - start, testing::kLoadSlack);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(d.status().message(), HasSubstr(server_->address()));
  EXPECT_EQ(w0->ReportPlan(PlanOf(0, 1, 1)).code(), absl::StatusCode::kUnavailable);
}

TEST_F(InProcessTest, ACoordinatorThatDoesNotComeBackFailsPendingCallsAtTheEndOfTheReconnectWindow) {
  WorkerOptions o = Options(0, 2, 2);
  o.reconnect_window = absl::Milliseconds(800);
  auto w0 = Connect(o);
  ASSERT_TRUE(w0);
  ASSERT_TRUE(w0->ReportPlan(PlanOf(0, 0, 1)).ok());
  std::thread stopper([&] { server_->Shutdown(absl::Milliseconds(100)); });
  const absl::Time start = absl::Now();
  auto d = w0->GetDecision({0, 0}, kDecisionTimeout);
  stopper.join();
  EXPECT_LT(absl::Now() - start, o.reconnect_window + testing::kLoadSlack);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(d.status().message(), HasSubstr("did not come back within the reconnect window (800 ms"));
  EXPECT_THAT(d.status().message(), HasSubstr(server_->address()));
  EXPECT_EQ(w0->ReportPlan(PlanOf(0, 1, 1)).code(), absl::StatusCode::kUnavailable);
}

TEST_F(InProcessTest, UnreachableCoordinatorFailsConnectWithinItsTimeout) {
  WorkerOptions o = Options(0, 2, 2);
  const std::string address = server_->address();
  server_->Shutdown(absl::Milliseconds(10));
  o.coordinator_address = address;
  o.connect_timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  auto w = Worker::Connect(o);
  EXPECT_LT(absl::Now() - start, testing::kLoadSlack);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(w.status().message(), HasSubstr("cannot reach coordinator at " + address));
}

TEST_F(InProcessTest, CommunicatorRendezvousRejectsBadInputAndKeepsWorking) {
  auto w0 = Connect(Options(0, 4, 2));
  auto w1 = Connect(Options(1, 4, 2));
  ASSERT_TRUE(w0 && w1);
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  auto call = [&](auto method, const auto& req, auto* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return FromGrpcStatus(((*stub).*method)(&ctx, req, resp));
  };
  // Another client acting for rank 0 (read from ListRanks): without the rank's session key
  // every communicator call is refused, naming why, and changes nothing.
  v1::CommJoinRequest join;
  join.set_job_id("job");
  join.set_rank(0);
  join.set_name("group/0");
  join.set_timeout_ms(100);
  v1::CommJoinResponse jresp;
  for (const std::string key : {"", "0123456789abcdef0123456789abcdef"}) {
    join.set_session_key(key);
    absl::Status s = call(&v1::Coordinator::Stub::CommJoin, join, &jresp);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << "key '" << key << "'";
    EXPECT_THAT(s.message(), HasSubstr("does not come from the rank's live session"));
    v1::StoreSetRequest set;
    set.set_job_id("job");
    set.set_rank(0);
    set.set_name("group/0");
    set.set_epoch(1);
    set.set_key("nccl_unique_id");
    set.set_value("forged");
    set.set_session_key(key);
    v1::StoreSetResponse sresp;
    EXPECT_EQ(call(&v1::Coordinator::Stub::StoreSet, set, &sresp).code(), absl::StatusCode::kPermissionDenied);
    v1::StoreGetRequest get;
    get.set_job_id("job");
    get.set_rank(0);
    get.set_name("group/0");
    get.set_epoch(1);
    get.add_keys("nccl_unique_id");
    get.set_timeout_ms(100);
    get.set_session_key(key);
    v1::StoreGetResponse gresp;
    EXPECT_EQ(call(&v1::Coordinator::Stub::StoreGet, get, &gresp).code(), absl::StatusCode::kPermissionDenied);
    v1::CommReportRequest report;
    report.set_job_id("job");
    report.set_rank(0);
    report.set_name("group/0");
    report.set_epoch(1);
    report.set_kind(v1::CommReportRequest::KIND_ERROR);
    report.set_error("forged failure");
    report.set_session_key(key);
    v1::CommReportResponse rresp;
    EXPECT_EQ(call(&v1::Coordinator::Stub::CommReport, report, &rresp).code(), absl::StatusCode::kPermissionDenied);
  }
  join.set_rank(3);  // Registered? No: rank 3 never connected.
  join.set_name("world");
  absl::Status s = call(&v1::Coordinator::Stub::CommJoin, join, &jresp);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("rank 3 of job 'job' is not a live registered rank"));
  // Nothing was created or aborted by the forged calls.
  v1::ListCommsRequest lreq;
  lreq.set_job_id("job");
  v1::ListCommsResponse lresp;
  ASSERT_TRUE(call(&v1::Coordinator::Stub::ListComms, lreq, &lresp).ok());
  EXPECT_EQ(lresp.comms_size(), 0);

  // The bad calls disturbed nothing: world works for the two live ranks of a 2-rank job.
  auto a = Connect(Options(0, 2, 2, Policy::kAuto, "comm-ok"));
  auto b = Connect(Options(1, 2, 2, Policy::kAuto, "comm-ok"));
  ASSERT_TRUE(a && b);
  int64_t va = 5, vb = 7;
  AllReduceOnWorld(*a, *b, &va, &vb, ReduceOp::kMax);
  EXPECT_EQ(va, 7);
  EXPECT_EQ(vb, 7);
}


TEST_F(InProcessTest, RegistrationsOverTheCapsAreAnsweredAndShutdownStillCompletes) {
  // Each of these used to be swallowed inside the gRPC callback (a 2^31-rank allocation),
  // leaking its stream and making a later shutdown hang.
  for (int i = 0; i < 3; ++i) {
    RawSession raw(server_->address());
    v1::RegisterRequest r = RawRequest(0, 2, 2);
    r.set_world_size(2147483646);
    auto resp = raw.Register(r);
    ASSERT_FALSE(resp.ok());
    EXPECT_EQ(resp.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(resp.status().message(), HasSubstr("max_world_size"));
  }
  auto w0 = Connect(Options(0, 2, 2));
  ASSERT_TRUE(w0) << "a legitimate job is still admitted";
  const absl::Time start = absl::Now();
  server_->Shutdown(absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, testing::kLoadSlack);
}

TEST_F(InProcessTest, ASessionThatNeverRegistersIsClosedAtTheHandshakeTimeoutSayingWhy) {
  server_->Shutdown(absl::Milliseconds(10));
  coordinator::CoordinatorOptions o;
  o.limits.handshake_timeout = absl::Milliseconds(300);
  StartServer(o);
  RawSession silent(server_->address());  // Opens the stream, sends nothing.
  v1::CoordinatorMessage in;
  EXPECT_FALSE(silent.stream->Read(&in));  // Bounded by the stream's own 20 s deadline.
  const grpc::Status s = silent.stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("no `register` within 300ms"));
  // A rank that registers in time is not affected, before or after the timeout.
  auto w = Connect(Options(0, 1, 1, Policy::kReplicate));
  absl::SleepFor(absl::Milliseconds(400));  // Past the registration deadline of its stream.
  const v1::ListRanksResponse ranks = server_->core().Ranks("job");
  ASSERT_EQ(ranks.ranks_size(), 1);
  EXPECT_EQ(ranks.ranks(0).state(), v1::RANK_STATE_LIVE);
}

class NonReaderTest : public InProcessTest {
 protected:
  // Starts a daemon with `o`; rank 0 (group 0, replicate: one decision per plan, at once)
  // plans and never reads; rank 1 must be served throughout. Returns rank 0's state once
  // it was failed (or after 60 s).
  v1::RankStatus FailANonReader(coordinator::CoordinatorOptions o);
};

v1::RankStatus NonReaderTest::FailANonReader(coordinator::CoordinatorOptions o) {
  NonReaderTest& t = *this;
  o.max_lookahead = 2000;  // Plans go in batches of 2000: within the window.
  t.StartServer(o);
  // The stream outlives the wait below: under ASan on a loaded machine, filling the buffers
  // took over 20 s once, and the stream's own deadline then ended it first.
  RawSession raw(t.server_->address(), /*deadline_s=*/90);
  v1::RegisterRequest r = RawRequest(0, 2, 1);
  r.set_policy(v1::POLICY_REPLICATE);
  r.set_lookahead(2000);
  v1::WorkerMessage reg;
  *reg.mutable_register_() = r;
  EXPECT_TRUE(raw.stream->Write(reg));
  auto w1 = t.Connect(t.Options(1, 2, 1, Policy::kReplicate));
  EXPECT_TRUE(w1);
  auto rank0_state = [&] { return t.server_->core().Ranks("job").ranks(0); };
  int64_t step = 0;
  // Flow control fills the transport's buffers first, then the daemon's queue for the rank.
  const bool failed = testing::WaitUntil(
      [&] {
        v1::WorkerMessage m;
        for (int i = 0; i < 2000; ++i) {
          auto* p = m.mutable_bundle()->mutable_plans()->add_plans();
          p->mutable_key()->set_step(step++);
          (*p->mutable_calls())["vision_tower"] = 1;
        }
        raw.stream->Write(m);
        return rank0_state().state() == v1::RANK_STATE_DEAD;
      },
      absl::Seconds(60), absl::Milliseconds(1));
  EXPECT_TRUE(failed) << "after " << step << " plans: " << rank0_state().DebugString();
  // The other rank is served as before.
  EXPECT_TRUE(w1->ReportPlan(PlanOf(0, 0, 1)).ok());
  auto d = w1->GetDecision({0, 0}, kDecisionTimeout);
  EXPECT_TRUE(d.ok()) << d.status();
  if (d.ok()) {
    EXPECT_EQ(d->Find("vision_tower")->decision, Decision::kReplicate);
  }
  raw.ctx.TryCancel();
  return rank0_state();
}

TEST_F(NonReaderTest, ARankThatNeverReadsIsFailedWithAReasonAndOthersAreServed) {
  server_->Shutdown(absl::Milliseconds(10));
  coordinator::CoordinatorOptions o;
  o.limits.max_outbox_bytes = 64 << 10;
  const v1::RankStatus rank0 = FailANonReader(o);
  EXPECT_THAT(rank0.dead_reason(), HasSubstr("not reading its session stream"));
  EXPECT_THAT(rank0.dead_reason(), HasSubstr("(max_outbox_bytes)"));
  EXPECT_EQ(server_->core().buffers()->used(), 0) << "its queue was given back";
}

TEST_F(NonReaderTest, ANonReaderIsFailedOnceTheDaemonsBuffersAreFullWhateverItsOwnBound) {
  // Issue 25: 8 ranks that stop reading held 8 x 16 MiB; the daemon-wide budget fails the
  // ranks that hold most of it, long before their own bound.
  server_->Shutdown(absl::Milliseconds(10));
  coordinator::CoordinatorOptions o;
  o.limits.max_outbox_bytes = 1 << 30;
  o.limits.max_buffered_bytes = 1 << 20;
  const v1::RankStatus rank0 = FailANonReader(o);
  EXPECT_THAT(rank0.dead_reason(), HasSubstr("not reading its session stream"));
  EXPECT_THAT(rank0.dead_reason(), HasSubstr("max_buffered_bytes 1048576"));
  EXPECT_EQ(server_->core().buffers()->used(), 0) << "its queue was given back";
}

TEST_F(InProcessTest, DecisionsQueuedBehindAWriteLeaveMergedInOrderAndGiveTheirBytesBack) {
  // 1,500 plans, one per message, to a rank that reads only once all are decided. Each decision
  // lists 300 modules (about 20 KB), so together they are far past what the stream's flow control
  // and the sockets hold: the writes stall, and later decisions queue behind the write in flight
  // and are merged into it (SessionSink::SendDecisions). They must all arrive, in order, at most 256 to a
  // write, and every byte they took from the daemon's budget must come back while the stream is
  // still open (not only when its queue is dropped at the end).
  server_->Shutdown(absl::Milliseconds(10));
  coordinator::CoordinatorOptions o;
  o.max_lookahead = 2000;
  o.heartbeat_interval = absl::Milliseconds(200);
  o.heartbeat_timeout = absl::Seconds(120);  // This raw client sends no heartbeat: it must stay live.
  o.limits.max_outbox_bytes = int64_t{256} << 20;  // It is not a non-reader: it reads them all below.
  StartServer(o);
  RawSession raw(server_->address(), /*deadline_s=*/60);
  v1::RegisterRequest r = RawRequest(0, 1, 1);
  r.set_policy(v1::POLICY_REPLICATE);  // One decision per plan, at once.
  r.set_lookahead(2000);
  for (int i = 0; i < 300; ++i) {
    v1::ModuleSpec* m = r.add_modules();
    m->set_name(absl::StrCat("model.audio_tower.encoder.a_module_name_long_enough_to_weigh_", i));
    m->set_param_bytes(4096);
  }
  ASSERT_TRUE(raw.Register(r).ok());
  constexpr int kPlans = 1500;
  for (int step = 0; step < kPlans; ++step) raw.SendPlan(RawPlan(step, 0, "vision_tower", 1));
  const auto decided = [&] {
    const v1::StatusResponse s = server_->core().Status("job");
    return s.jobs_size() == 1 ? s.jobs(0).microbatches_decided() : int64_t{0};
  };
  ASSERT_TRUE(testing::WaitUntil([&] { return decided() == kPlans; }, absl::Seconds(30), absl::Milliseconds(1)))
      << decided() << " of " << kPlans << " decided";
  int messages = 0;
  int64_t next = 0;
  v1::CoordinatorMessage in;
  while (next < kPlans && raw.stream->Read(&in)) {
    if (!in.has_decisions()) continue;
    ++messages;
    EXPECT_LE(in.decisions().decisions_size(), 256) << "one write holds at most kMaxDecisionsPerWrite";
    EXPECT_NE(in.incarnation(), 0u) << "every write names the daemon's incarnation";
    for (const v1::MicrobatchDecision& d : in.decisions().decisions()) {
      ASSERT_EQ(d.key().step(), next) << "decisions out of order or lost";
      ++next;
    }
  }
  EXPECT_EQ(next, kPlans);
  EXPECT_LT(messages, kPlans) << "no write carried more than one decision: nothing was merged";
  EXPECT_TRUE(testing::WaitUntil([&] { return server_->core().buffers()->used() == 0; }, absl::Seconds(30),
                                 absl::Milliseconds(1)))
      << server_->core().buffers()->used() << " bytes still charged with the stream open and its queue written";
  EXPECT_EQ(server_->core().Ranks("job").ranks(0).state(), v1::RANK_STATE_LIVE)
      << "the bytes must come back from the written queue, not from a dead rank's dropped one";
  raw.ctx.TryCancel();
}

TEST_F(InProcessTest, AClientSendingARetiredKindAfterRegisteringIsToldWhatToSend) {
  // Issue 27: plans alone (WorkerMessage field 2, now reserved) would parse as an
  // empty message, which a newer peer's unknown kind is, and be ignored: the sender would
  // wait for decisions forever. The daemon names the encoding and closes the stream.
  RawSession raw(server_->address());
  ASSERT_TRUE(raw.Register(RawRequest(0, 2, 1)).ok());
  v1::PlanBatch batch;
  *batch.add_plans() = RawPlan(0, 0, "vision_tower", 1);
  v1::WorkerMessage m;
  m.GetReflection()->MutableUnknownFields(&m)->AddLengthDelimited(2, batch.SerializeAsString());
  ASSERT_TRUE(raw.stream->Write(m));
  EXPECT_FALSE(raw.Next(v1::CoordinatorMessage::kDecisions).has_value());
  const grpc::Status end = raw.stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(end.error_message(), HasSubstr("one kind per message (WorkerMessage fields 2, 3, 5"));
  EXPECT_THAT(end.error_message(), HasSubstr("send them in a WorkerMessage.bundle"));
}

TEST_F(InProcessTest, ARegistrationThatCannotBeParsedIsAnsweredWithAnError) {
  // The probe: invalid UTF-8 in a registration ended the stream OK, with no answer.
  RawSession raw(server_->address());
  v1::RegisterRequest req = RawRequest(0, 2, 1);
  req.set_host("host\xff\xfe");  // Serialized as is; the daemon's parser refuses it.
  absl::StatusOr<v1::RegisterResponse> r = raw.Register(req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("could not be parsed (every string must be valid UTF-8"));
  EXPECT_TRUE(RawSession(server_->address()).Register(RawRequest(0, 2, 1)).ok()) << "the daemon goes on";
}

TEST_F(InProcessTest, AMessageThatCannotBeParsedAfterRegisteringEndsTheStreamWithTheReason) {
  // The session's reads are raw (its writes are decisions encoded once per group): a message that
  // does not parse is refused by name, where gRPC's typed reads ended the stream as a close.
  RawSession raw(server_->address());
  ASSERT_TRUE(raw.Register(RawRequest(0, 2, 1)).ok());
  raw.SendPlan(RawPlan(0, 0, "vision_tower\xff", 1));  // Serialized as is; the daemon's parser refuses it.
  EXPECT_FALSE(raw.Next(v1::CoordinatorMessage::kDecisions).has_value());
  const grpc::Status end = raw.stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << end.error_message();
  EXPECT_THAT(end.error_message(), HasSubstr("a message on the Session could not be parsed (every string must be "
                                             "valid UTF-8"));
  // The stream is ended first (so the client reads this cause, not the death that follows), then
  // the rank is declared dead: the client may see the end before the death.
  const auto rank0 = [&] { return server_->core().Ranks("job").ranks(0); };
  EXPECT_TRUE(testing::WaitUntil([&] { return rank0().state() == v1::RANK_STATE_DEAD; }, absl::Seconds(30),
                                 absl::Milliseconds(1)))
      << rank0().DebugString();
  EXPECT_THAT(rank0().dead_reason(), HasSubstr("could not be parsed")) << "the rank's status names the cause";
  EXPECT_TRUE(RawSession(server_->address()).Register(RawRequest(1, 2, 1)).ok()) << "the daemon goes on";
}

TEST_F(InProcessTest, AMessageOverTheReceiveLimitEndsOnlyItsStream) {
  // The raw Session keeps gRPC's receive limit (4 MiB): a bigger message is refused before it is
  // parsed, the stream ends with the limit named, and the daemon goes on.
  RawSession raw(server_->address());
  ASSERT_TRUE(raw.Register(RawRequest(0, 2, 1)).ok());
  raw.SendPlan(RawPlan(0, 0, std::string(5 << 20, 'm'), 1));
  EXPECT_FALSE(raw.Next(v1::CoordinatorMessage::kDecisions).has_value());
  const grpc::Status end = raw.stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << end.error_message();
  EXPECT_TRUE(RawSession(server_->address()).Register(RawRequest(1, 2, 1)).ok()) << "the daemon goes on";
}

TEST_F(InProcessTest, APlanBatchBeyondTheLookaheadWindowFailsTheSenderForWhatItDid) {
  // Issue 25: one batch of 10^5 plans made 10^5 rejections that filled the sender's own
  // outbox: it was failed as "not reading". The batch breaks the protocol; it says so.
  server_->Shutdown(absl::Milliseconds(10));
  coordinator::CoordinatorOptions o;
  o.heartbeat_interval = absl::Milliseconds(200);
  o.heartbeat_timeout = absl::Seconds(60);  // This raw client sends no heartbeat; under ASan the batch takes seconds.
  StartServer(o);
  RawSession raw(server_->address());
  ASSERT_TRUE(raw.Register(RawRequest(0, 2, 1)).ok());
  v1::WorkerMessage m;
  for (int i = 0; i < 20000; ++i) {
    auto* p = m.mutable_bundle()->mutable_plans()->add_plans();
    p->mutable_key()->set_step(i);
    (*p->mutable_calls())["vision_tower"] = 1;
  }
  raw.stream->Write(m);  // May fail once the daemon has cut the rank.
  auto rank0 = [&] { return server_->core().Ranks("job").ranks(0); };
  ASSERT_TRUE(testing::WaitUntil([&] { return rank0().state() == v1::RANK_STATE_DEAD; }, absl::Seconds(30)))
      << rank0().DebugString();
  EXPECT_THAT(rank0().dead_reason(), HasSubstr("broke the protocol: sent 20000 plans in one batch; with a "
                                               "lookahead window of 4 a worker sends at most 24"));
  EXPECT_EQ(rank0().plans_rejected(), 0) << "not one rejection was queued for them";
}

// Serves a hand-written coordinator on a loopback port of its own until destroyed.
class LoopbackServer {
 public:
  explicit LoopbackServer(grpc::Service* service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
  }
  ~LoopbackServer() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  bool ok() const { return server_ != nullptr && port_ != 0; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// A coordinator that registers the rank and answers each plan with a decision no worker
// can carry out: decision value 77 for microbatch 0, one module missing for the others, and
// for microbatch 2 no key either (what a coordinator of the wire before MicrobatchKey sends).
class UnusableDecisionCoordinator final : public v1::Coordinator::Service {
 public:
  uint32_t wire_revision = shardcoord::kWireRevision;  // 0: as a coordinator built before keys.

  grpc::Status Session(grpc::ServerContext*,
                       grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override {
    v1::WorkerMessage in;
    if (!stream->Read(&in) || !in.has_register_()) return grpc::Status::OK;
    v1::CoordinatorMessage reg;
    reg.set_incarnation(7);
    auto* r = reg.mutable_registered();
    r->add_group_ranks(0);
    r->set_heartbeat_interval_ms(100);
    r->set_heartbeat_timeout_ms(5000);
    r->set_policy(v1::POLICY_AUTO);
    r->set_fallback(v1::FALLBACK_ROOT);
    r->set_lookahead(4);
    r->set_incarnation(7);
    r->set_wire_revision(wire_revision);
    stream->Write(reg);
    while (stream->Read(&in)) {
      const v1::PlanBatch& plans = in.bundle().plans();
      for (const auto& p : plans.plans()) {
        v1::CoordinatorMessage out;
        out.set_incarnation(7);
        auto* d = out.mutable_decisions()->add_decisions();
        if (p.key().microbatch() != 2) *d->mutable_key() = p.key();  // 2: no key, as an older wire's.
        for (size_t i = 0; i < (p.key().microbatch() == 0 ? kModules.size() : 1); ++i) {
          auto* m = d->add_modules();
          m->set_module(kModules[i]);
          m->set_decision(p.key().microbatch() == 0 ? static_cast<v1::Decision>(77) : v1::DECISION_SKIP);
          m->set_reason(v1::REASON_ALL_SKIP);
        }
        stream->Write(out);
      }
    }
    return grpc::Status::OK;
  }
};

TEST_F(InProcessTest, ADecisionTheWorkerCannotCarryOutIsAnErrorNeverHandedToTheTrainer) {
  // Issue 25: the Python worker handed its trainer 'unspecified' decisions, or one missing a
  // module (KeyError). The worker refuses them whatever the coordinator sends.
  UnusableDecisionCoordinator service;
  LoopbackServer forger(&service);
  ASSERT_TRUE(forger.ok());
  WorkerOptions o = Options(0, 1, 1);
  o.coordinator_address = forger.address();
  auto w = Connect(o);
  ASSERT_TRUE(w);
  ASSERT_TRUE(w->ReportPlan(PlanOf(0, 0, 1)).ok());
  ASSERT_TRUE(w->ReportPlan(PlanOf(0, 1, 1)).ok());
  auto unknown = w->GetDecision({0, 0}, kDecisionTimeout);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInternal) << unknown.status();
  EXPECT_THAT(unknown.status().message(), HasSubstr("has decision value 77, which is no decision this worker knows"));
  auto missing = w->GetDecision({0, 1}, kDecisionTimeout);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInternal) << missing.status();
  EXPECT_THAT(missing.status().message(), HasSubstr("it names 1 modules, the manifest has 2"));
  // A decision without a key could be for any microbatch: what is pending fails, naming why.
  ASSERT_TRUE(w->ReportPlan(PlanOf(0, 2, 1)).ok());
  auto keyless = w->GetDecision({0, 2}, kDecisionTimeout);
  EXPECT_EQ(keyless.status().code(), absl::StatusCode::kFailedPrecondition) << keyless.status();
  EXPECT_THAT(keyless.status().message(), HasSubstr("a decision without a key"));
  w->Close(absl::Seconds(1));
}

TEST_F(InProcessTest, AWorkerRefusesACoordinatorOfAnotherWireRevisionAtConnect) {
  // A coordinator built before microbatches were named by a MicrobatchKey would read every
  // plan as (0,0): the worker must not go on past registration with it.
  UnusableDecisionCoordinator service;
  service.wire_revision = 0;
  LoopbackServer old(&service);
  ASSERT_TRUE(old.ok());
  WorkerOptions o = Options(0, 1, 1);
  o.coordinator_address = old.address();
  absl::StatusOr<std::unique_ptr<Worker>> w = Worker::Connect(o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kFailedPrecondition) << w.status();
  EXPECT_THAT(w.status().message(), HasSubstr("speaks wire revision 0 (built before microbatches were named"));
  EXPECT_THAT(w.status().message(), HasSubstr("same shardcoord release"));
}

TEST_F(InProcessTest, TheWorkerLibraryKeepsSigpipeFromKillingItsHost) {
  signal(SIGPIPE, SIG_DFL);
  auto w0 = Connect(Options(0, 2, 2));
  ASSERT_TRUE(w0);
  struct sigaction now {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_IGN) << "a write to a dead peer's socket would kill the trainer";
  // A write to a pipe nobody reads fails with EPIPE instead of killing this process.
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  close(fds[0]);
  EXPECT_EQ(write(fds[1], "x", 1), -1);
  EXPECT_EQ(errno, EPIPE);
  close(fds[1]);
}


TEST_F(InProcessTest, PlanAheadKeepsTheWindowFullAndReturnsDecisionsInOrder) {
  auto w0 = Connect(Options(0, 2, 2));
  auto w1 = Connect(Options(1, 2, 2));
  ASSERT_TRUE(w0 && w1);
  constexpr int64_t kTotal = 7;
  auto plan_of = [](int64_t i) { return PlanOf(i / 2, static_cast<int>(i % 2), static_cast<int>(i % 3 == 0)); };
  PlanAhead a0(*w0, kTotal, plan_of, /*lookahead=*/3);
  PlanAhead a1(*w1, kTotal, plan_of);  // The group's lookahead (4).
  std::vector<absl::StatusOr<MicrobatchDecision>> got1;
  std::thread rank1([&] {  // Each rank's loop in its own thread, as in two processes.
    while (!a1.done()) got1.push_back(a1.Next(kDecisionTimeout));
  });
  std::vector<MicrobatchDecision> got;
  while (!a0.done()) {
    auto d0 = a0.Next(kDecisionTimeout);
    ASSERT_TRUE(d0.ok()) << d0.status();
    EXPECT_EQ(d0->key, a0.key());
    EXPECT_EQ(a0.plan().calls, plan_of(a0.index() - 1).calls) << "the plan reported for it";
    EXPECT_LE(w0->UndecidedPlans(), 3) << "never more than the lookahead in flight";
    got.push_back(*d0);
  }
  rank1.join();
  ASSERT_EQ(got1.size(), static_cast<size_t>(kTotal));
  for (int64_t i = 0; i < kTotal; ++i) {
    ASSERT_TRUE(got1[i].ok()) << got1[i].status();
    EXPECT_EQ(got1[i]->digest, got[i].digest);
  }
  ASSERT_EQ(got.size(), static_cast<size_t>(kTotal));
  for (int64_t i = 0; i < kTotal; ++i) {
    EXPECT_EQ(got[i].key, plan_of(i).key);
    EXPECT_EQ(got[i].Find("vision_tower")->decision, i % 3 == 0 ? Decision::kPerLayer : Decision::kSkip);
  }
  auto after = a0.Next(kDecisionTimeout);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
  // A lookahead beyond the group's window (4), or below one, is refused as Python refuses it.
  for (int bad : {5, -1}) {
    PlanAhead wide(*w0, kTotal, plan_of, bad);
    auto refused = wide.Next(kDecisionTimeout);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("must be in 1..4"));
  }
}

// ---------------------------------------------------------------------------------------
// gRPC health (grpc.health.v1), as load balancers and Kubernetes probes call it

// Calls grpc.health.v1.Health/Check for `service`; the status code and the serving status
// (1 SERVING, 2 NOT_SERVING), decoded from the two-byte HealthCheckResponse.
std::pair<grpc::StatusCode, int> HealthCheck(const std::string& address, const std::string& service) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  std::string request;  // HealthCheckRequest{service}: field 1, length-delimited.
  if (!service.empty()) request = std::string("\x0a") + static_cast<char>(service.size()) + service;
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (status.ok() && resp.Dump(&slices).ok()) {
    for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return {status.error_code(), bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0};
}

TEST_F(InProcessTest, TheHealthServiceSaysServingUntilShutdownWithoutAToken) {
  EXPECT_EQ(HealthCheck(server_->address(), ""), std::make_pair(grpc::StatusCode::OK, 1));
  EXPECT_EQ(HealthCheck(server_->address(), coordinator::kHealthServiceName), std::make_pair(grpc::StatusCode::OK, 1));
  EXPECT_EQ(HealthCheck(server_->address(), "no.such.Service").first, grpc::StatusCode::NOT_FOUND);
  // A daemon with tokens answers health checks without one (they reveal nothing else).
  testing::TempDir dir;
  const std::string tokens = dir.File("tokens");
  std::ofstream(tokens) << "read read-token-0123456789abcdef\n";
  ASSERT_EQ(chmod(tokens.c_str(), 0600), 0);
  coordinator::CoordinatorOptions o;
  o.token_file = tokens;
  StartServer(o);
  EXPECT_EQ(HealthCheck(server_->address(), ""), std::make_pair(grpc::StatusCode::OK, 1));
}

// ---------------------------------------------------------------------------------------
// Tokens with roles (DESIGN 13)

class TokenTest : public InProcessTest {
 protected:
  static constexpr char kRank[] = "rank-token-0123456789abcdef";
  static constexpr char kRead[] = "read-token-0123456789abcdef";
  static constexpr char kAdmin[] = "admin-token-0123456789abcdef";
  static constexpr char kRankOfA[] = "rank-of-job-a-0123456789abcdef";
  static constexpr char kReadOfA[] = "read-of-job-a-0123456789abcdef";

  void SetUp() override {
    path_ = dir_.File("tokens");
    std::ofstream(path_) << "# roles\nrank " << kRank << "\nread " << kRead << "\nadmin " << kAdmin << "\n"
                         << "rank " << kRankOfA << " job=a\nread " << kReadOfA << " job=a\n";
    ASSERT_EQ(chmod(path_.c_str(), 0600), 0);
    coordinator::CoordinatorOptions o;
    o.token_file = path_;
    StartServer(o);
  }

  absl::Status Status(const std::string& token) {
    auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    v1::StatusResponse resp;
    return FromGrpcStatus(stub->GetStatus(&ctx, v1::StatusRequest(), &resp));
  }

  testing::TempDir dir_;
  std::string path_;
};

TEST_F(TokenTest, EveryCallNeedsAKnownTokenOfARoleAllowedToMakeIt) {
  // Operator queries: read or admin.
  EXPECT_EQ(Status("").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(Status("").message(), HasSubstr("no token"));
  EXPECT_EQ(Status("not-a-token-of-this-coordinator").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Status(kRank).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Status(kRank).message(), HasSubstr("needs a token of role read"));
  EXPECT_TRUE(Status(kRead).ok());
  EXPECT_TRUE(Status(kAdmin).ok());
  // Registration: rank or admin. Without one, nobody can take a rank (the lock-out attack).
  WorkerOptions o = Options(0, 2, 2);
  for (const std::string bad : {"", "wrong-token-0123456789", kRead}) {
    o.token = bad;
    auto w = Worker::Connect(o);
    ASSERT_FALSE(w.ok()) << "token '" << bad << "'";
    EXPECT_TRUE(w.status().code() == absl::StatusCode::kUnauthenticated ||
                w.status().code() == absl::StatusCode::kPermissionDenied)
        << w.status();
  }
  EXPECT_EQ(Status(kAdmin).code(), absl::StatusCode::kOk);
  // With the rank token a job runs as before, communicators included.
  o.token = kRank;
  WorkerOptions o1 = Options(1, 2, 2);
  o1.token = kRank;
  auto w0 = Connect(o);
  auto w1 = Connect(o1);
  ASSERT_TRUE(w0 && w1);
  ASSERT_NO_FATAL_FAILURE(DecideTogether(*w0, *w1, 0));
  int64_t a = 2, b = 3;
  AllReduceOnWorld(*w0, *w1, &a, &b, ReduceOp::kSum);
  EXPECT_EQ(a, 5);
  EXPECT_EQ(b, 5);
}

// Every RPC without a token, with an unknown one and with one of the wrong role: refused with
// UNAUTHENTICATED / PERMISSION_DENIED, and the live job goes on unharmed.
TEST_F(TokenTest, EveryRpcRefusesMissingWrongAndUnderprivilegedTokensAndTheJobGoesOn) {
  WorkerOptions o0 = Options(0, 2, 2), o1 = Options(1, 2, 2);
  o0.token = o1.token = kRank;
  auto w0 = Connect(o0);
  auto w1 = Connect(o1);
  ASSERT_TRUE(w0 && w1);
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  // Each RPC, called with a token, about job "job"; returns the status.
  using Stub = v1::Coordinator::Stub;
  std::map<std::string, std::function<absl::Status(const std::string&)>> call;
  auto unary = [&](const std::string& rpc, auto method, auto req, auto resp) {
    req.set_job_id("job");
    call[rpc] = [&stub, method, req, resp](const std::string& token) mutable {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
      return FromGrpcStatus(((*stub).*method)(&ctx, req, &resp));
    };
  };
  unary("GetStatus", &Stub::GetStatus, v1::StatusRequest(), v1::StatusResponse());
  unary("ListRanks", &Stub::ListRanks, v1::ListRanksRequest(), v1::ListRanksResponse());
  unary("ListGroups", &Stub::ListGroups, v1::ListGroupsRequest(), v1::ListGroupsResponse());
  unary("ListDecisions", &Stub::ListDecisions, v1::ListDecisionsRequest(), v1::ListDecisionsResponse());
  unary("ListEvents", &Stub::ListEvents, v1::ListEventsRequest(), v1::ListEventsResponse());
  unary("ListComms", &Stub::ListComms, v1::ListCommsRequest(), v1::ListCommsResponse());
  unary("CommJoin", &Stub::CommJoin, v1::CommJoinRequest(), v1::CommJoinResponse());
  unary("StoreSet", &Stub::StoreSet, v1::StoreSetRequest(), v1::StoreSetResponse());
  unary("StoreGet", &Stub::StoreGet, v1::StoreGetRequest(), v1::StoreGetResponse());
  v1::CommReportRequest forged_error;  // The one-call kill of a job, were it accepted.
  forged_error.set_name("world");
  forged_error.set_kind(v1::CommReportRequest::KIND_ERROR);
  unary("CommReport", &Stub::CommReport, forged_error, v1::CommReportResponse());
  call["Session"] = [&](const std::string& token) {  // A registration for rank 0 (the lock-out).
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    auto stream = stub->Session(&ctx);
    v1::WorkerMessage m;
    m.mutable_register_()->set_job_id("job");
    stream->Write(m);
    stream->WritesDone();
    v1::CoordinatorMessage in;
    while (stream->Read(&in)) {
    }
    return FromGrpcStatus(stream->Finish());
  };
  const std::vector<std::string> reads = {"GetStatus",     "ListRanks",  "ListGroups",
                                          "ListDecisions", "ListEvents", "ListComms"};
  const std::vector<std::string> ranks = {"CommJoin", "StoreSet", "StoreGet", "CommReport", "Session"};
  for (const auto& [rpcs, wrong_role] : {std::make_pair(&reads, kRank), std::make_pair(&ranks, kRead)}) {
    for (const auto& rpc : *rpcs) {
      EXPECT_EQ(call.at(rpc)("").code(), absl::StatusCode::kUnauthenticated) << rpc;
      EXPECT_EQ(call.at(rpc)("forged-token-0123456789abcdef").code(), absl::StatusCode::kUnauthenticated) << rpc;
      EXPECT_EQ(call.at(rpc)(wrong_role).code(), absl::StatusCode::kPermissionDenied) << rpc;
      EXPECT_EQ(call.at(rpc)(kReadOfA).code(), absl::StatusCode::kPermissionDenied) << rpc;  // Role, or job.
    }
  }
  // The job is unharmed: both ranks live, a decision and a collective still work.
  EXPECT_TRUE(w0->Health().ok()) << w0->Health();
  EXPECT_TRUE(w1->Health().ok()) << w1->Health();
  ASSERT_NO_FATAL_FAILURE(DecideTogether(*w0, *w1, 0));
  int64_t a = 1, b = 2;
  AllReduceOnWorld(*w0, *w1, &a, &b, ReduceOp::kSum);
  EXPECT_EQ(b, 3);
}

// A token limited to one job (`job=ID`) registers, joins and queries for that job only; the
// `read` role sees no process ids.
TEST_F(TokenTest, AJobTokenActsForItsJobOnlyAndReadersSeeNoPids) {
  WorkerOptions b = Options(0, 1, 1, Policy::kAuto, "b");
  b.token = kRankOfA;
  auto refused = Worker::Connect(b);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.status().message(), HasSubstr("the token is for job 'a' only"));
  b.token = kRank;
  auto wb = Connect(b);
  WorkerOptions a = Options(0, 1, 1, Policy::kAuto, "a");
  a.token = kRankOfA;
  auto wa = Connect(a);
  ASSERT_TRUE(wa && wb);
  // Job a's token cannot read job b's rendezvous data.
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  auto store_get = [&](const std::string& token, const std::string& job) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::StoreGetRequest req;
    req.set_job_id(job);
    req.set_name("world");
    req.add_keys("rank_0");
    v1::StoreGetResponse resp;
    return FromGrpcStatus(stub->StoreGet(&ctx, req, &resp));
  };
  absl::Status s = store_get(kRankOfA, "b");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("StoreGet: the token is for job 'a' only"));
  // For its own job the token passes (the call then fails on the missing session key).
  EXPECT_THAT(store_get(kRankOfA, "a").message(), ::testing::Not(HasSubstr("the token is for job")));
  // Queries: a reader of job a sees job a (asked or not), never job b.
  auto ranks = [&](const std::string& token, const std::string& job, v1::ListRanksResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::ListRanksRequest req;
    req.set_job_id(job);
    return FromGrpcStatus(stub->ListRanks(&ctx, req, resp));
  };
  v1::ListRanksResponse resp;
  ASSERT_TRUE(ranks(kReadOfA, "", &resp).ok());
  ASSERT_EQ(resp.ranks_size(), 1);
  EXPECT_EQ(resp.ranks(0).job_id(), "a");
  EXPECT_EQ(resp.ranks(0).pid(), 0) << "readers see no pids";
  EXPECT_EQ(ranks(kReadOfA, "b", &resp).code(), absl::StatusCode::kPermissionDenied);
  resp.Clear();
  ASSERT_TRUE(ranks(kRead, "", &resp).ok());
  EXPECT_EQ(resp.ranks_size(), 2);
  for (const auto& r : resp.ranks()) EXPECT_EQ(r.pid(), 0);
  resp.Clear();
  ASSERT_TRUE(ranks(kAdmin, "", &resp).ok());
  ASSERT_EQ(resp.ranks_size(), 2);
  for (const auto& r : resp.ranks()) EXPECT_EQ(r.pid(), getpid()) << "admins see them";
  // A token line with a bad job field is refused naming the line.
  std::ofstream(path_) << "rank " << kRank << " jobs=a\n";
  EXPECT_THAT(coordinator::Tokens::Load(path_).status().message(), HasSubstr("line 1: the third field must be job=ID"));
}

TEST(TokenFileTest, AFileOpenToOthersOrMalformedIsRefusedNamingWhy) {
  testing::TempDir dir;
  const std::string path = dir.File("tokens");
  std::ofstream(path) << "rank 0123456789abcdef0123\n";
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  auto t = coordinator::Tokens::Load(path);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(t.status().message(), HasSubstr("mode 644"));
  EXPECT_THAT(t.status().message(), HasSubstr("chmod 600"));
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  EXPECT_TRUE(coordinator::Tokens::Load(path).ok());
  std::ofstream(path) << "writer 0123456789abcdef0123\n";
  EXPECT_THAT(coordinator::Tokens::Load(path).status().message(), HasSubstr("line 1: unknown role"));
  std::ofstream(path) << "rank short\n";
  t = coordinator::Tokens::Load(path);
  EXPECT_THAT(t.status().message(), HasSubstr("shorter than 16 bytes"));
  EXPECT_THAT(t.status().message(), ::testing::Not(HasSubstr("short\n")));
  // Without tokens the daemon serves loopback only, unless told --insecure.
  coordinator::CoordinatorOptions o;
  o.listen_address = "0.0.0.0:0";
  absl::Status s = coordinator::ValidateOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("give --token-file"));
  o.insecure = true;
  EXPECT_TRUE(coordinator::ValidateOptions(o).ok());
  o.insecure = false;
  o.token_file = path;
  o.tls.cert_file = "server.pem";  // Read at start (tls_test.cc), not here.
  EXPECT_TRUE(coordinator::ValidateOptions(o).ok());
  EXPECT_TRUE(coordinator::IsLoopbackAddress("[::1]:7871"));
  EXPECT_TRUE(coordinator::IsLoopbackAddress("localhost:1"));
  EXPECT_FALSE(coordinator::IsLoopbackAddress("10.0.0.1:7871"));
}

}  // namespace
}  // namespace shardcoord
