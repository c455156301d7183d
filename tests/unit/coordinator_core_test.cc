// Unit tests of CoordinatorCore: registration validation, plan validation, decisions,
// failure detection and queries, driven through a recording RankSink and a fake clock.
#include "coordinator/core/coordinator_core.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "support/core_fakes.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using shardcoord::testing::FakeClock;
using shardcoord::testing::RecordingSink;

CoordinatorOptions CoreTestOptions() {
  CoordinatorOptions o;
  o.heartbeat_interval = absl::Milliseconds(100);
  o.heartbeat_timeout = absl::Milliseconds(1000);
  o.plan_timeout = absl::Seconds(10);
  o.max_lookahead = 8;
  return o;
}

class CoreTest : public ::testing::Test, protected shardcoord::testing::CoreHarness {
 protected:
  CoreTest() : CoreHarness(CoreTestOptions()) {}

  static v1::RegisterRequest Request(int rank, int world = 4, int group_size = 2,
                                     v1::Policy policy = v1::POLICY_AUTO) {
    v1::RegisterRequest r;
    r.set_job_id("job");
    r.set_wire_revision(shardcoord::kWireRevision);
    r.set_rank(rank);
    r.set_world_size(world);
    r.set_group_size(group_size);
    r.set_policy(policy);
    r.set_fallback(v1::FALLBACK_ROOT);
    r.set_wrap_outer_model(true);
    r.set_lookahead(4);
    for (const char* name : {"vision_tower", "audio_tower"}) {
      auto* m = r.add_modules();
      m->set_name(name);
      m->set_param_bytes(1000);
    }
    return r;
  }

  using CoreHarness::Register;

  void RegisterAll(int world = 4, int group_size = 2, v1::Policy policy = v1::POLICY_AUTO) {
    for (int r = 0; r < world; ++r) ASSERT_TRUE(Register(Request(r, world, group_size, policy)).ok());
  }

  void Plan(int rank, int64_t step, int mb, int vision, int audio = 0) {
    v1::PlanBatch batch;
    const v1::ListGroupsResponse groups = core_->Groups("job");
    for (const auto& g : groups.groups()) {
      if (std::find(g.ranks().begin(), g.ranks().end(), rank) != g.ranks().end()) batch.set_epoch(g.epoch());
    }
    auto* p = batch.add_plans();
    p->mutable_key()->set_step(step);
    p->mutable_key()->set_microbatch(mb);
    (*p->mutable_calls())["vision_tower"] = vision;
    (*p->mutable_calls())["audio_tower"] = audio;
    OnPlans(sessions_[rank], batch);
  }

  v1::RankStatus RankStatusOf(int rank) {
    const v1::ListRanksResponse all = core_->Ranks("job");
    for (const auto& r : all.ranks()) {
      if (r.rank() == rank) return r;
    }
    return {};
  }

};

// ---------------------------------------------------------------------------------------
// Registration validation

TEST_F(CoreTest, RegistrationAnswersWithGroupAndEffectiveSettings) {
  v1::RegisterRequest r = Request(3);
  r.set_policy(v1::POLICY_UNSPECIFIED);
  r.set_lookahead(0);
  ASSERT_TRUE(Register(r).ok());
  ASSERT_EQ(sinks_[3]->messages.size(), 1u);
  const auto& resp = sinks_[3]->messages[0].registered();
  EXPECT_EQ(resp.group(), 1);
  EXPECT_THAT(std::vector<int>(resp.group_ranks().begin(), resp.group_ranks().end()),
              ::testing::ElementsAre(2, 3));
  EXPECT_EQ(resp.policy(), v1::POLICY_AUTO);  // The coordinator's default.
  EXPECT_EQ(resp.lookahead(), kDefaultLookahead);
  EXPECT_EQ(resp.heartbeat_timeout_ms(), 1000);
}

TEST_F(CoreTest, UnknownRankIsInvalidArgument) {
  absl::Status s = Register(Request(4, /*world=*/4));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("unknown rank 4"));
  EXPECT_THAT(s.message(), HasSubstr("0..3"));
  s = Register(Request(-1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(core_->Status("").jobs().empty()) << "a rejected registration must change nothing";
}

TEST_F(CoreTest, MalformedRegistrationsAreInvalidArgument) {
  v1::RegisterRequest r = Request(0);
  r.set_job_id("");
  EXPECT_EQ(Register(r).code(), absl::StatusCode::kInvalidArgument);
  r = Request(0, /*world=*/4, /*group_size=*/3);
  absl::Status s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("group_size 3"));
  r = Request(0);
  r.mutable_modules(1)->set_name("vision_tower");
  s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'vision_tower' twice"));
  r = Request(0);
  r.set_lookahead(9);
  s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("lookahead 9"));
}

TEST_F(CoreTest, WorldSizeMismatchIsFailedPrecondition) {
  ASSERT_TRUE(Register(Request(0, 4)).ok());
  absl::Status s = Register(Request(1, 8));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("world_size 4"));
  EXPECT_THAT(s.message(), HasSubstr("rank 1 registered with 8"));
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_UNREGISTERED);
}

TEST_F(CoreTest, AWorkerOfAnotherWireRevisionIsRefusedAtRegistrationNamingBoth) {
  // A worker built before MicrobatchKey sends no revision (0); its plans' keys would read as (0,0).
  v1::RegisterRequest old = Request(0);
  old.clear_wire_revision();
  absl::Status s = Register(old);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("rank 0 of job 'job' speaks wire revision 0"));
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("this build ", shardcoord::kWireRevision)));
  EXPECT_EQ(core_->Status("").jobs_size(), 0) << "nothing of it was taken: no job was created";
  // Told its revision first, even when its request would fail other checks too (what it
  // lacks may be only what an older wire did not carry).
  old.set_world_size(0);
  EXPECT_THAT(Register(old).message(), HasSubstr("speaks wire revision 0"));
  v1::RegisterRequest newer = Request(0);
  newer.set_wire_revision(shardcoord::kWireRevision + 1);
  EXPECT_EQ(Register(newer).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Register(Request(0)).ok());
  auto registered = sinks_[0]->Where([](const v1::CoordinatorMessage& m) { return m.has_registered(); });
  ASSERT_EQ(registered.size(), 1u);
  EXPECT_EQ(registered[0].registered().wire_revision(), shardcoord::kWireRevision)
      << "the response says which revision the coordinator speaks";
}

TEST_F(CoreTest, DuplicateLiveRankIsAlreadyExists) {
  v1::RegisterRequest first = Request(0);
  first.set_host("node-7");
  first.set_pid(424242);
  ASSERT_TRUE(Register(first).ok());
  auto first_sink = sinks_[0];
  absl::Status s = core_->Register(99, FromWire(Request(0)), std::make_shared<RecordingSink>());
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("duplicate rank 0"));
  EXPECT_THAT(s.message(), HasSubstr("node-7")) << "the host holding it, to find it";
  EXPECT_THAT(s.message(), Not(HasSubstr("424242"))) << "no pid to a rank-token holder (issue 25)";
  EXPECT_FALSE(first_sink->closed) << "the live session must be left alone";
  EXPECT_EQ(RankStatusOf(0).registrations(), 1);
}

TEST_F(CoreTest, ManifestMismatchNamesModuleAndRanks) {
  ASSERT_TRUE(Register(Request(0)).ok());
  v1::RegisterRequest r = Request(1);
  r.mutable_modules(0)->set_param_bytes(2000);
  absl::Status s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("module 'vision_tower'"));
  EXPECT_THAT(s.message(), HasSubstr("2000 on rank 1"));
  EXPECT_THAT(s.message(), HasSubstr("1000 on rank 0"));

  r = Request(1);
  r.mutable_modules()->RemoveLast();
  s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("[vision_tower]"));

  // A different group may not be compared with group 0: rank 2 is in group 1.
  v1::RegisterRequest other_group = r;
  other_group.set_rank(2);
  EXPECT_TRUE(Register(other_group).ok());
}

TEST_F(CoreTest, PolicyMismatchIsFailedPrecondition) {
  ASSERT_TRUE(Register(Request(0)).ok());
  absl::Status s = Register(Request(1, 4, 2, v1::POLICY_PER_LAYER));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("policy per_layer"));
  EXPECT_THAT(s.message(), HasSubstr("rank 0 registered auto"));
}

TEST_F(CoreTest, RootWithoutOuterRootIsRejectedWithWaysOut) {
  v1::RegisterRequest r = Request(0, 4, 2, v1::POLICY_ROOT);
  r.set_wrap_outer_model(false);
  r.mutable_modules(0)->set_outside_inner_root(true);
  absl::Status s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("policy root"));
  EXPECT_THAT(s.message(), HasSubstr("[vision_tower]"));
  EXPECT_THAT(s.message(), HasSubstr("fallback replicate"));
  EXPECT_THAT(s.message(), HasSubstr("policy replicate"));

  r.set_policy(v1::POLICY_AUTO);  // fallback root
  s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("fallback root"));

  r.set_fallback(v1::FALLBACK_REPLICATE);
  EXPECT_TRUE(Register(r).ok());
  // Inside the inner root, root stays possible without the outer root.
  v1::RegisterRequest inside = Request(2, 4, 2, v1::POLICY_ROOT);
  inside.set_wrap_outer_model(false);
  EXPECT_TRUE(Register(inside).ok());
}

TEST_F(CoreTest, PerLayerRegistrationWarns) {
  ASSERT_TRUE(Register(Request(0, 4, 2, v1::POLICY_PER_LAYER)).ok());
  const auto& resp = sinks_[0]->messages[0].registered();
  ASSERT_EQ(resp.warnings_size(), 1);
  EXPECT_THAT(resp.warnings(0), HasSubstr("fall back to root"));
  bool found = false;
  for (const auto& e : core_->Events("job", 0, 100)) found |= e.kind() == "per_layer_requested";
  EXPECT_TRUE(found);
}

// ---------------------------------------------------------------------------------------
// Decisions

TEST_F(CoreTest, GroupGetsOneIdenticalDecisionPerMicrobatch) {
  RegisterAll();
  Plan(0, 0, 0, 1, 0);
  EXPECT_TRUE(sinks_[0]->Decisions().empty()) << "must wait for rank 1";
  Plan(1, 0, 0, 1, 0);
  auto d0 = sinks_[0]->Decisions();
  auto d1 = sinks_[1]->Decisions();
  ASSERT_EQ(d0.size(), 1u);
  ASSERT_EQ(d1.size(), 1u);
  EXPECT_EQ(d0[0].SerializeAsString(), d1[0].SerializeAsString());
  EXPECT_EQ(d0[0].seq(), 0u);
  EXPECT_EQ(d0[0].modules(0).module(), "vision_tower");
  EXPECT_EQ(d0[0].modules(0).decision(), v1::DECISION_PER_LAYER);
  EXPECT_EQ(d0[0].modules(1).decision(), v1::DECISION_SKIP);
  EXPECT_TRUE(sinks_[2]->Decisions().empty()) << "group 1 decides on its own plans only";

  Plan(0, 0, 1, 1);
  Plan(1, 0, 1, 0);
  d0 = sinks_[0]->Decisions();
  ASSERT_EQ(d0.size(), 2u);
  EXPECT_EQ(d0[1].seq(), 1u);
  EXPECT_EQ(d0[1].modules(0).decision(), v1::DECISION_ROOT);
  EXPECT_EQ(d0[1].modules(0).reason(), v1::REASON_DIVERGENT);
}

TEST_F(CoreTest, ATrainableModuleIsDecidedRootWhereTheFallbackWouldReplicateAndSaysSo) {
  for (int r = 0; r < 2; ++r) {
    v1::RegisterRequest req = Request(r, 2, 2);
    req.set_fallback(v1::FALLBACK_REPLICATE);
    req.mutable_modules(0)->set_trainable(true);  // vision_tower trains; audio_tower is frozen.
    ASSERT_TRUE(Register(req).ok());
  }
  Plan(0, 0, 0, 1, 1);
  Plan(1, 0, 0, 0, 0);
  const auto d = sinks_[0]->Decisions();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].modules(0).decision(), v1::DECISION_ROOT);
  EXPECT_EQ(d[0].modules(1).decision(), v1::DECISION_REPLICATE);
  int said = 0;
  for (const auto& e : core_->Events("job", 0, 100)) said += e.kind() == "module_trainable_root";
  EXPECT_EQ(said, 1);
  const v1::StatusResponse st = core_->Status("job");
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_THAT(st.jobs(0).trainable_modules(), ::testing::ElementsAre("vision_tower"));
}

class StaticPolicyTest : public CoreTest, public ::testing::WithParamInterface<v1::Policy> {};

TEST_F(CoreTest, StaticPolicyNeverWaitsForTheGroup) {
  ASSERT_TRUE(Register(Request(0, 4, 2, v1::POLICY_REPLICATE)).ok());
  Plan(0, 0, 0, 1);  // Rank 1 has not even registered.
  auto d = sinks_[0]->Decisions();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].modules(0).decision(), v1::DECISION_REPLICATE);
  EXPECT_EQ(d[0].modules(0).reason(), v1::REASON_STATIC_POLICY);
}

TEST_F(CoreTest, AStaticGroupThatFormsAfterItsFirstRankPlannedAheadKeepsItsDecisions) {
  // Issue 27 (found by chaos.short): with one seq for every policy, the first rank's static
  // decisions made the group's formation look like a re-form, which began a new epoch,
  // dropped those keys and gave the second rank other decisions (another seq) for them.
  ASSERT_TRUE(Register(Request(0, 4, 2, v1::POLICY_REPLICATE)).ok());
  for (int mb = 0; mb < 4; ++mb) Plan(0, 0, mb, 1);
  ASSERT_TRUE(Register(Request(1, 4, 2, v1::POLICY_REPLICATE)).ok());
  for (int mb = 0; mb < 4; ++mb) Plan(1, 0, mb, 1);
  auto d0 = sinks_[0]->Decisions(), d1 = sinks_[1]->Decisions();
  ASSERT_EQ(d0.size(), 4u);
  ASSERT_EQ(d1.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(d1[i].seq(), d0[i].seq()) << "microbatch " << i;
    EXPECT_EQ(d1[i].digest(), d0[i].digest()) << "microbatch " << i;
    EXPECT_EQ(d1[i].epoch(), 0);
  }
  auto groups = core_->Groups("job");
  EXPECT_EQ(groups.groups(0).epoch(), 0);
  EXPECT_EQ(groups.groups(0).next_seq(), 4u);
  EXPECT_EQ(groups.groups(0).pending_microbatches(), 0);
}

TEST_F(CoreTest, AGroupThatFailedBeforeItFormedReFormsInANewEpochWithANotice) {
  // Issue 27 review: ranks 0 and 1 live, rank 1 dies before rank 2 ever registered. Rank 0
  // holds the group's failure; the group's first whole state must be a re-form it hears of.
  ASSERT_TRUE(Register(Request(0, 3, 3)).ok());
  ASSERT_TRUE(Register(Request(1, 3, 3)).ok());
  core_->OnSessionClosed(sessions_[1], "killed");
  ASSERT_EQ(sinks_[0]->Where([](const auto& m) { return m.has_group_failure(); }).size(), 1u);
  ASSERT_TRUE(Register(Request(1, 3, 3)).ok());
  ASSERT_TRUE(Register(Request(2, 3, 3)).ok());
  const auto g = core_->Groups("job").groups(0);
  EXPECT_EQ(g.state(), v1::GROUP_STATE_HEALTHY);
  EXPECT_EQ(g.epoch(), 1);
  EXPECT_EQ(sinks_[0]->Where([](const auto& m) {
                        return m.has_notice() && m.notice().kind() == v1::Notice::KIND_GROUP_REFORMED;
                      }).size(),
            1u);
}

TEST_F(CoreTest, AKeyAfterALaterFailedOneIsStillDecided) {
  // Issue 27 review: B and C report (0,0), B reports (0,1), C leaves (failing (0,1), which it
  // never planned), then A reports (0,0): it is decided, as before, with no internal error.
  RegisterAll(3, 3);
  Plan(1, 0, 0, 1);
  Plan(2, 0, 0, 1);
  Plan(1, 0, 1, 1);
  core_->OnGoodbye(sessions_[2], "done");
  Plan(0, 0, 0, 1);
  auto d = sinks_[0]->Decisions();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].key().microbatch(), 0);
  EXPECT_EQ(sinks_[1]->Decisions().size(), 1u);
}

TEST_F(CoreTest, ARerunOfAJobThatReFormedStillFormsItsGroupsAfresh) {
  // Issue 27 review: after a re-form (epoch 1) and every rank leaving, the rerun's group
  // forms (no new epoch, no re-form notice), and its static decisions are the group's.
  RegisterAll(2, 2, v1::POLICY_REPLICATE);
  core_->OnSessionClosed(sessions_[1], "killed");
  ASSERT_TRUE(Register(Request(1, 2, 2, v1::POLICY_REPLICATE)).ok());
  ASSERT_EQ(core_->Groups("job").groups(0).epoch(), 1);
  core_->OnGoodbye(sessions_[0], "done");
  core_->OnGoodbye(sessions_[1], "done");
  ASSERT_TRUE(Register(Request(0, 2, 2, v1::POLICY_REPLICATE)).ok());
  ASSERT_TRUE(Register(Request(1, 2, 2, v1::POLICY_REPLICATE)).ok());
  EXPECT_EQ(core_->Groups("job").groups(0).epoch(), 1) << "formed afresh, not re-formed";
  EXPECT_TRUE(sinks_[0]->Where([](const auto& m) { return m.has_notice(); }).empty());
  Plan(0, 0, 0, 1);
  Plan(1, 0, 0, 1);
  auto d0 = sinks_[0]->Decisions(), d1 = sinks_[1]->Decisions();
  ASSERT_EQ(d0.size(), 1u);
  ASSERT_EQ(d1.size(), 1u);
  EXPECT_EQ(d1[0].seq(), d0[0].seq());
  EXPECT_EQ(d1[0].digest(), d0[0].digest());
}

TEST_F(CoreTest, ARerunWhoseRanksComeBackOneByOneIsDecided) {
  // Issue 44, item 5: in a rerun under the same id and sizes, the member that had not registered
  // again yet counted as left, so the first rank's plans failed ("can never be decided") and the
  // second's were stale. The members of the ended run wait to come back, as in a forming job.
  RegisterAll(2, 2);
  Plan(0, 0, 0, 1);
  Plan(1, 0, 0, 1);
  core_->OnGoodbye(sessions_[0], "done");
  core_->OnGoodbye(sessions_[1], "done");
  ASSERT_TRUE(Register(Request(0, 2, 2)).ok());
  Plan(0, 0, 0, 1);
  Plan(0, 0, 1, 0);
  EXPECT_TRUE(sinks_[0]->Where([](const auto& m) { return m.has_microbatch_failed(); }).empty())
      << "the rerun's first rank was failed before the second came back";
  ASSERT_TRUE(Register(Request(1, 2, 2)).ok());
  Plan(1, 0, 0, 1);
  Plan(1, 0, 1, 0);
  EXPECT_TRUE(sinks_[1]->Where([](const auto& m) { return m.has_microbatch_failed() || m.has_plan_rejected(); })
                  .empty());
  auto d0 = sinks_[0]->Decisions(), d1 = sinks_[1]->Decisions();
  ASSERT_EQ(d0.size(), 2u);
  ASSERT_EQ(d1.size(), 2u);
  EXPECT_EQ(d0[1].digest(), d1[1].digest());
}

TEST_F(CoreTest, TwoGroupsDecideIndependently) {
  RegisterAll();
  Plan(0, 0, 0, 1);  // Group 0 waits for rank 1.
  Plan(2, 0, 0, 1);
  Plan(3, 0, 0, 1);
  EXPECT_EQ(sinks_[2]->Decisions().size(), 1u);
  EXPECT_EQ(sinks_[3]->Decisions().size(), 1u);
  EXPECT_TRUE(sinks_[0]->Decisions().empty());
}

TEST_F(CoreTest, RankThatSkipsAMicrobatchFailsItForTheGroup) {
  RegisterAll();
  Plan(0, 0, 0, 1);
  Plan(0, 0, 1, 1);
  Plan(1, 0, 1, 1);  // Rank 1 never reports (0,0).
  auto failed = sinks_[0]->Where([](const auto& m) { return m.has_microbatch_failed(); });
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].microbatch_failed().key().microbatch(), 0);
  EXPECT_EQ(failed[0].microbatch_failed().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(failed[0].microbatch_failed().message(), HasSubstr("rank 1 reported (0,1) without reporting (0,0)"));
  auto d = sinks_[1]->Decisions();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].key().microbatch(), 1);
}

// ---------------------------------------------------------------------------------------
// Bad plans: rejected with a code, the session and everyone else keep going

TEST_F(CoreTest, BadPlansAreRejectedWithPreciseCodes) {
  RegisterAll();
  Plan(0, 0, 0, 1);
  Plan(1, 0, 0, 1);
  ASSERT_EQ(sinks_[0]->Decisions().size(), 1u);
  const std::string before = sinks_[0]->Decisions()[0].SerializeAsString();

  Plan(0, -1, 0, 1);  // malformed
  v1::PlanBatch unknown;
  auto* p = unknown.add_plans();
  p->mutable_key()->set_step(0);
  p->mutable_key()->set_microbatch(1);
  (*p->mutable_calls())["vison_tower"] = 1;
  OnPlans(sessions_[0], unknown);  // unknown module
  Plan(0, 0, 0, 1);                       // out of order (already planned (0,0))
  Plan(0, 0, 1, -2);                      // negative calls
  auto rej = sinks_[0]->Rejections();
  ASSERT_EQ(rej.size(), 4u);
  EXPECT_EQ(rej[0].code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(rej[0].message(), HasSubstr(">= 0"));
  EXPECT_EQ(rej[1].code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(rej[1].message(), HasSubstr("unknown module 'vison_tower'"));
  EXPECT_THAT(rej[1].message(), HasSubstr("vision_tower, audio_tower"));
  EXPECT_EQ(rej[2].code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(rej[2].message(), HasSubstr("out-of-order plan (0,0)"));
  EXPECT_EQ(rej[3].code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(RankStatusOf(0).plans_rejected(), 4);

  // Nothing decided changed, and the group keeps deciding.
  EXPECT_EQ(sinks_[1]->Decisions()[0].SerializeAsString(), before);
  EXPECT_TRUE(sinks_[1]->Rejections().empty());
  Plan(0, 0, 1, 0);
  Plan(1, 0, 1, 0);
  ASSERT_EQ(sinks_[1]->Decisions().size(), 2u);
  EXPECT_EQ(sinks_[1]->Decisions()[1].modules(0).decision(), v1::DECISION_SKIP);
}

TEST_F(CoreTest, PlansBeyondTheLookaheadWindowAreResourceExhausted) {
  RegisterAll();
  for (int mb = 0; mb < 4; ++mb) Plan(0, 0, mb, 1);  // lookahead 4, rank 1 silent
  EXPECT_TRUE(sinks_[0]->Rejections().empty());
  Plan(0, 0, 4, 1);
  auto rej = sinks_[0]->Rejections();
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0].code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(rej[0].message(), HasSubstr("lookahead window"));
  // Once rank 1 catches up the window frees and the plan is accepted.
  Plan(1, 0, 0, 1);
  Plan(0, 0, 4, 1);
  EXPECT_EQ(sinks_[0]->Rejections().size(), 1u);
  EXPECT_EQ(RankStatusOf(0).pending_plans(), 4);
}

// What ranks report cumulatively is totalled across their worker processes: a report lower than
// the last one is a new worker counting from zero, so the totals (Prometheus counters) never go
// down, and a hostile huge report saturates instead of overflowing.
TEST_F(CoreTest, ReportedCountsAreTotalledAcrossWorkerRestartsAndNeverGoDown) {
  RegisterAll();
  auto beat = [&](int64_t stalls, int64_t stall_us) {
    v1::Heartbeat hb;
    hb.set_decision_stalls(stalls);
    hb.set_decision_stall_us(stall_us);
    OnHeartbeat(sessions_[0], hb);
    return RankStatusOf(0);
  };
  EXPECT_EQ(beat(5, 1000).decision_stalls(), 5);
  EXPECT_EQ(beat(7, 1500).decision_stalls(), 7);
  const v1::RankStatus after_restart = beat(2, 100);  // A new worker: 2 more, not 7 -> 2.
  EXPECT_EQ(after_restart.decision_stalls(), 9);
  EXPECT_EQ(after_restart.decision_stall_us(), 1600);
  EXPECT_EQ(beat(-4, -1).decision_stalls(), 9);  // Negative reports are ignored.
  EXPECT_EQ(beat(INT64_MAX, INT64_MAX).decision_stalls(), INT64_MAX);
  EXPECT_EQ(beat(INT64_MAX, 1).decision_stalls(), INT64_MAX);  // Saturated, not wrapped.
}

// ---------------------------------------------------------------------------------------
// Failures

TEST_F(CoreTest, SilentRankIsDeclaredDeadAndItsGroupIsToldWhy) {
  RegisterAll();
  Plan(0, 0, 0, 1);
  clock_->Advance(absl::Milliseconds(600));
  OnHeartbeat(sessions_[0]);
  OnHeartbeat(sessions_[2]);
  OnHeartbeat(sessions_[3]);
  core_->Tick();
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_LIVE);
  clock_->Advance(absl::Milliseconds(600));  // rank 1 silent for 1200 ms > 1000 ms
  OnHeartbeat(sessions_[2]);
  OnHeartbeat(sessions_[3]);
  OnHeartbeat(sessions_[0]);
  core_->Tick();

  v1::RankStatus dead = RankStatusOf(1);
  EXPECT_EQ(dead.state(), v1::RANK_STATE_DEAD);
  EXPECT_THAT(dead.dead_reason(), HasSubstr("no heartbeat for 1200 ms"));
  EXPECT_TRUE(sinks_[1]->closed);
  auto failures = sinks_[0]->Where([](const auto& m) { return m.has_group_failure(); });
  ASSERT_EQ(failures.size(), 1u);
  const auto& gf = failures[0].group_failure();
  EXPECT_THAT(std::vector<int>(gf.dead_ranks().begin(), gf.dead_ranks().end()), ::testing::ElementsAre(1));
  EXPECT_THAT(gf.reason(), HasSubstr("rank 1 declared dead"));
  ASSERT_EQ(gf.cancelled_size(), 1);
  EXPECT_EQ(gf.cancelled(0).microbatch(), 0);
  // Group 1 is untouched, but told: its collectives across groups include rank 1 too.
  EXPECT_TRUE(sinks_[2]->Where([](const auto& m) { return m.has_group_failure(); }).empty());
  EXPECT_EQ(core_->Groups("job").groups(1).state(), v1::GROUP_STATE_HEALTHY);
  for (int r : {2, 3}) {
    auto lost = sinks_[r]->Where([](const auto& m) {
      return m.has_notice() && m.notice().kind() == v1::Notice::KIND_RANK_LOST;
    });
    ASSERT_EQ(lost.size(), 1u) << "rank " << r;
    EXPECT_EQ(lost[0].notice().rank(), 1);
    EXPECT_EQ(lost[0].notice().group(), 0);
    EXPECT_THAT(lost[0].notice().message(), HasSubstr("rank 1 declared dead: no heartbeat"));
  }
  EXPECT_TRUE(sinks_[0]->Where([](const auto& m) { return m.has_notice(); }).empty()) << "its own group gets the failure";
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FAILED);

  // A survivor's plan is refused until the group re-forms.
  Plan(0, 0, 1, 1);
  auto rej = sinks_[0]->Rejections();
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0].code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_THAT(rej[0].message(), HasSubstr("rank 1"));
}

TEST_F(CoreTest, DeadRankRegisteringAgainReformsTheGroupUnderANewEpoch) {
  RegisterAll();
  core_->OnSessionClosed(sessions_[1], "test cut the stream");
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_DEAD);
  EXPECT_THAT(RankStatusOf(1).dead_reason(), HasSubstr("test cut the stream"));
  ASSERT_TRUE(Register(Request(1)).ok());
  EXPECT_EQ(core_->Groups("job").groups(0).epoch(), 1);
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_HEALTHY);
  auto notices = sinks_[0]->Where([](const auto& m) {
    return m.has_notice() && m.notice().kind() == v1::Notice::KIND_GROUP_REFORMED;
  });
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].notice().epoch(), 1);
  Plan(0, 0, 5, 1);
  Plan(1, 0, 5, 1);
  auto d = sinks_[1]->Decisions();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].epoch(), 1);
  EXPECT_EQ(RankStatusOf(1).registrations(), 2);
}

TEST_F(CoreTest, FailedGroupReformsOnlyWhenEveryMemberIsLiveAndKeysStartAfresh) {
  RegisterAll();
  for (int mb = 0; mb < 3; ++mb) {
    Plan(0, 0, mb, 1);
    Plan(1, 0, mb, 1);
  }
  core_->OnSessionClosed(sessions_[1], "killed");
  core_->OnGoodbye(sessions_[0], "trainer exits after the failure");
  ASSERT_TRUE(Register(Request(1)).ok());  // The restarted rank 1 comes back first...
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FORMING)
      << "rank 0 only left: the group must not decide without it";
  ASSERT_TRUE(Register(Request(0)).ok());  // ... then rank 0.
  auto g = core_->Groups("job").groups(0);
  EXPECT_EQ(g.state(), v1::GROUP_STATE_HEALTHY);
  EXPECT_EQ(g.epoch(), 1);
  // Resumed from a checkpoint: earlier keys are planned again and decided in the new epoch.
  Plan(0, 0, 1, 0);
  Plan(1, 0, 1, 0);
  EXPECT_TRUE(sinks_[0]->Rejections().empty()) << sinks_[0]->Rejections()[0].message();
  auto d = sinks_[1]->Decisions();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].epoch(), 1);
  EXPECT_EQ(d[0].seq(), 3u) << "seq goes on across epochs";
  EXPECT_EQ(d[0].modules(0).decision(), v1::DECISION_SKIP);
}

TEST_F(CoreTest, AFinishedJobCanRunAgainUnderTheSameId) {
  RegisterAll();
  Plan(0, 0, 0, 1);
  Plan(1, 0, 0, 1);
  core_->OnGoodbye(sessions_[0], "done");
  core_->OnGoodbye(sessions_[1], "done");
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FINISHED);
  ASSERT_TRUE(Register(Request(0)).ok());
  ASSERT_TRUE(Register(Request(1)).ok());
  Plan(0, 0, 0, 1);
  Plan(1, 0, 0, 1);
  EXPECT_TRUE(sinks_[0]->Rejections().empty());
  ASSERT_EQ(sinks_[0]->Decisions().size(), 1u);
  EXPECT_EQ(sinks_[0]->Decisions()[0].epoch(), 1);
}

TEST_F(CoreTest, PlanTimeoutFailsTheMicrobatchNamingMissingRanks) {
  RegisterAll();
  Plan(0, 0, 0, 1);
  clock_->Advance(absl::Seconds(11));
  for (int r = 0; r < 4; ++r) OnHeartbeat(sessions_[r]);
  core_->Tick();
  auto failed = sinks_[1]->Where([](const auto& m) { return m.has_microbatch_failed(); });
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].microbatch_failed().code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(failed[0].microbatch_failed().message(), HasSubstr("from ranks 1 (ranks 0 reported it)"));
  EXPECT_EQ(RankStatusOf(0).pending_plans(), 0);
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_LIVE);
}

TEST_F(CoreTest, CleanLeaveFailsOnlyWhatTheLeaverNeverPlanned) {
  RegisterAll();
  Plan(0, 0, 0, 1);
  Plan(1, 0, 0, 1);
  Plan(0, 0, 1, 1);
  core_->OnGoodbye(sessions_[1], "done");
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_LEFT);
  auto failed = sinks_[0]->Where([](const auto& m) { return m.has_microbatch_failed(); });
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_THAT(failed[0].microbatch_failed().message(), HasSubstr("rank 1 left the job"));
  EXPECT_TRUE(sinks_[0]->Where([](const auto& m) { return m.has_group_failure(); }).empty());
  core_->OnGoodbye(sessions_[0], "done");
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FINISHED);
}

TEST_F(CoreTest, PlansFromBeforeAFailureAreRejectedInTheNextEpoch) {
  RegisterAll();
  core_->OnSessionClosed(sessions_[1], "killed");
  ASSERT_TRUE(Register(Request(1)).ok());
  ASSERT_EQ(core_->Groups("job").groups(0).epoch(), 1);
  v1::PlanBatch stale;
  stale.set_epoch(0);
  auto* p = stale.add_plans();
  p->mutable_key()->set_step(5);
  p->mutable_key()->set_microbatch(0);
  OnPlans(sessions_[0], stale);
  auto rej = sinks_[0]->Rejections();
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0].code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_THAT(rej[0].message(), HasSubstr("made in epoch 0 but group 0 is at epoch 1"));
  EXPECT_EQ(core_->Groups("job").groups(0).pending_microbatches(), 0);
}

TEST_F(CoreTest, StatusCountsDecisionsByKind) {
  RegisterAll();
  Plan(0, 0, 0, 1, 0);
  Plan(1, 0, 0, 1, 1);
  auto st = core_->Status("job");
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).counts().per_layer(), 1);
  EXPECT_EQ(st.jobs(0).counts().root(), 1);
  EXPECT_EQ(st.jobs(0).counts().divergent(), 1);
  EXPECT_EQ(st.jobs(0).ranks_live(), 4);
  EXPECT_EQ(st.jobs(0).plans_received(), 2);
  auto decisions = core_->Decisions("job", 0, 10);
  ASSERT_EQ(decisions.decisions_size(), 1);
  EXPECT_EQ(decisions.decisions(0).decision().seq(), 0u);
}

TEST_F(CoreTest, ShutdownTellsEverySessionAndClosesIt) {
  RegisterAll();
  core_->Shutdown();
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(sinks_[r]->closed);
    EXPECT_EQ(sinks_[r]->close_status.code(), absl::StatusCode::kUnavailable);
    EXPECT_FALSE(sinks_[r]->Where([](const auto& m) { return m.has_notice(); }).empty());
  }
  EXPECT_EQ(Register(Request(0)).code(), absl::StatusCode::kUnavailable);
}


// ---- Static policies keep the group invariant (issue: one rank's view hid a divergence).

TEST_P(StaticPolicyTest, EveryRankGetsTheSameSeqAndDigestPerKeyEvenWhenOneSkips) {
  RegisterAll(4, 2, GetParam());
  // Rank 0 plans (0,0) and (0,1); rank 1 plans only (0,1): it skipped (0,0).
  Plan(0, 0, 0, 1);
  Plan(0, 0, 1, 1);
  Plan(1, 0, 1, 1);
  auto d0 = sinks_[0]->Decisions();
  auto d1 = sinks_[1]->Decisions();
  ASSERT_EQ(d0.size(), 2u);
  ASSERT_EQ(d1.size(), 1u);
  EXPECT_EQ(d1[0].key().microbatch(), 1);
  EXPECT_EQ(d1[0].seq(), d0[1].seq()) << "same key, same seq on every rank";
  EXPECT_EQ(d1[0].digest(), d0[1].digest());
  // ... and the skipped microbatch fails for the whole group, as under auto.
  for (int r : {0, 1}) {
    auto failed = sinks_[r]->Where([](const auto& m) { return m.has_microbatch_failed(); });
    ASSERT_EQ(failed.size(), 1u) << "rank " << r;
    EXPECT_EQ(failed[0].microbatch_failed().key().microbatch(), 0);
    EXPECT_THAT(failed[0].microbatch_failed().message(), HasSubstr("rank 1 reported (0,1) without reporting (0,0)"));
  }
}

TEST_P(StaticPolicyTest, ARankThatLeftAndCameBackContinuesTheGroupsSeqs) {
  RegisterAll(4, 2, GetParam());
  for (int mb = 0; mb < 3; ++mb) {
    Plan(0, 0, mb, 1);
    Plan(1, 0, mb, 1);
  }
  core_->OnGoodbye(sessions_[1], "restart");
  ASSERT_TRUE(Register(Request(1, 4, 2, GetParam())).ok());
  // A key the group already resolved is stale for the returning rank, as under auto.
  Plan(1, 0, 2, 1);
  auto rej = sinks_[1]->Rejections();
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_THAT(rej[0].message(), HasSubstr("is stale"));
  Plan(0, 0, 3, 1);
  Plan(1, 0, 3, 1);
  auto d0 = sinks_[0]->Decisions();
  auto d1 = sinks_[1]->Decisions();  // The new session's sink.
  ASSERT_EQ(d0.size(), 4u);
  ASSERT_EQ(d1.size(), 1u);
  EXPECT_EQ(d1[0].seq(), 3u);
  EXPECT_EQ(d1[0].seq(), d0[3].seq());
  EXPECT_EQ(d1[0].digest(), d0[3].digest());
}

TEST_P(StaticPolicyTest, ARankFarAheadOfItsGroupIsToldToWait) {
  CoordinatorOptions o = options_;
  o.limits.max_pending_microbatches = 3;
  Reset(o);
  RegisterAll(4, 2, GetParam());
  for (int mb = 0; mb < 4; ++mb) Plan(0, 0, mb, 1);  // Rank 1 reports nothing.
  EXPECT_EQ(sinks_[0]->Decisions().size(), 3u);
  auto rej = sinks_[0]->Rejections();
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0].code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(rej[0].message(), HasSubstr("max_pending_microbatches"));
  // Once rank 1 catches up, rank 0 may go on.
  for (int mb = 0; mb < 3; ++mb) Plan(1, 0, mb, 1);
  Plan(0, 0, 4, 1);
  EXPECT_EQ(sinks_[0]->Decisions().size(), 4u);
}

INSTANTIATE_TEST_SUITE_P(RootAndReplicate, StaticPolicyTest,
                         ::testing::Values(v1::POLICY_ROOT, v1::POLICY_REPLICATE));

TEST_F(CoreTest, RejectionsCarryTheEpochOfTheRejectedPlan) {
  RegisterAll();
  core_->OnSessionClosed(sessions_[1], "test");
  ASSERT_TRUE(Register(Request(1)).ok());  // Re-formed at epoch 1.
  v1::PlanBatch old;
  old.set_epoch(0);  // Queued before the failure, arriving after the re-form.
  auto* p = old.add_plans();
  p->mutable_key()->set_step(0);
  (*p->mutable_calls())["vision_tower"] = 1;
  OnPlans(sessions_[0], old);
  auto rej = sinks_[0]->Rejections();
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0].epoch(), 0) << "so the worker can tell it from the same key planned in epoch 1";
}

// ---- Bounds: caps on registrations, queues and retention.

TEST_F(CoreTest, RegistrationsOverTheCapsAreRefusedNamingTheCap) {
  CoordinatorOptions o = options_;
  o.limits.max_world_size = 1024;
  o.limits.max_modules = 4;
  o.limits.max_units_per_module = 2;
  o.limits.max_name_bytes = 16;
  Reset(o);
  struct Case {
    std::function<void(v1::RegisterRequest&)> edit;
    absl::StatusCode code;
    std::string text;
  };
  std::vector<Case> cases = {
      {[](auto& r) { r.set_world_size(2147483646); }, absl::StatusCode::kResourceExhausted, "max_world_size (1024)"},
      {[](auto& r) { r.set_job_id(std::string(1 << 20, 'j')); }, absl::StatusCode::kInvalidArgument, "max_name_bytes"},
      {[](auto& r) { r.set_host(std::string(100, 'h')); }, absl::StatusCode::kInvalidArgument, "host is 100 bytes"},
      {[](auto& r) {
         for (int i = 0; i < 5; ++i) r.add_modules()->set_name("m" + std::to_string(i));
       },
       absl::StatusCode::kResourceExhausted, "max_modules (4)"},
      {[](auto& r) {
         for (int i = 0; i < 3; ++i) r.mutable_modules(0)->add_units()->set_name("u" + std::to_string(i));
       },
       absl::StatusCode::kResourceExhausted, "max_units_per_module (2)"},
      {[](auto& r) {  // The rest unit "" at most once.
         r.mutable_modules(0)->add_units();
         r.mutable_modules(0)->add_units();
       },
       absl::StatusCode::kInvalidArgument, "rest unit \"\" at position 1"},
      {[](auto& r) {
         r.mutable_modules(0)->add_units()->set_name("layers.0");
         r.mutable_modules(0)->add_units()->set_name("layers.0");
       },
       absl::StatusCode::kInvalidArgument, "lists layer unit 'layers.0' twice"},
      {[](auto& r) {
         auto* u = r.mutable_modules(0)->add_units();
         u->set_name("layer0");
         u->set_param_bytes(-5);
       },
       absl::StatusCode::kInvalidArgument, "negative param_bytes -5"},
      {[](auto& r) { r.set_memory_budget_bytes(-1); }, absl::StatusCode::kInvalidArgument, "memory_budget_bytes -1"},
  };
  for (const auto& c : cases) {
    v1::RegisterRequest r = Request(0);
    c.edit(r);
    absl::Status s = Register(r);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.text));
  }
  EXPECT_TRUE(core_->Status("").jobs().empty()) << "nothing was created";
  EXPECT_TRUE(Register(Request(0)).ok());
}

TEST_F(CoreTest, JobsAreCappedAndEndedOnesEvictedAfterTheirRetention) {
  CoordinatorOptions o = options_;
  o.limits.max_jobs = 2;
  o.limits.job_retention = absl::Seconds(60);
  Reset(o);
  auto job = [](const std::string& id) {
    v1::RegisterRequest r = Request(0, 1, 1);
    r.set_job_id(id);
    return r;
  };
  ASSERT_TRUE(Register(job("a")).ok());  // session 1
  ASSERT_TRUE(Register(job("b")).ok());  // session 2
  absl::Status full = Register(job("c"));  // session 3, refused
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()), HasSubstr("max_jobs (2)"));
  // Job "a" ends: the next new job takes its place at once.
  core_->OnGoodbye(1, "done");
  ASSERT_TRUE(Register(job("c")).ok());  // session 4
  auto ids = [&] {
    std::vector<std::string> out;
    const v1::StatusResponse st = core_->Status("");
    for (const auto& j : st.jobs()) out.push_back(j.job_id());
    return out;
  };
  EXPECT_THAT(ids(), ::testing::ElementsAre("b", "c"));
  // An ended job is kept for the retention, then forgotten by the tick.
  core_->OnGoodbye(2, "done");
  clock_->Advance(absl::Seconds(59));
  OnHeartbeat(4);  // "c" stays live.
  core_->Tick();
  EXPECT_THAT(ids(), ::testing::ElementsAre("b", "c"));
  clock_->Advance(absl::Seconds(2));
  OnHeartbeat(4);
  core_->Tick();
  EXPECT_THAT(ids(), ::testing::ElementsAre("c"));
}

TEST_F(CoreTest, AJobWithNoLiveRankRunsAgainWithAnotherPolicyOrSize) {
  RegisterAll(2, 2, v1::POLICY_AUTO);
  core_->OnGoodbye(sessions_[0], "done");
  core_->OnGoodbye(sessions_[1], "done");
  // A rerun with the same size and another policy: the job keeps its history.
  ASSERT_TRUE(Register(Request(0, 2, 2, v1::POLICY_PER_LAYER)).ok());
  ASSERT_TRUE(Register(Request(1, 2, 2, v1::POLICY_PER_LAYER)).ok());
  auto groups = core_->Groups("job");
  ASSERT_EQ(groups.groups_size(), 1);
  EXPECT_EQ(groups.groups(0).policy(), v1::POLICY_PER_LAYER);
  EXPECT_EQ(core_->Ranks("job").ranks(0).registrations(), 2);
  // While a rank is live, a mismatch is still an error.
  EXPECT_EQ(Register(Request(0, 2, 2, v1::POLICY_AUTO)).code(), absl::StatusCode::kAlreadyExists);
  core_->OnGoodbye(sessions_[0], "done");
  EXPECT_EQ(Register(Request(0, 2, 2, v1::POLICY_AUTO)).code(), absl::StatusCode::kFailedPrecondition);
  // Once none is live, a rerun with another size starts the job afresh.
  core_->OnGoodbye(sessions_[1], "done");
  ASSERT_TRUE(Register(Request(0, 4, 2, v1::POLICY_ROOT)).ok());
  EXPECT_EQ(core_->Groups("job").groups_size(), 2);
  EXPECT_EQ(core_->Ranks("job").ranks(0).registrations(), 1);
}

TEST_F(CoreTest, AnEndedJobKeepsOnlyItsLastDecisions) {
  RegisterAll(2, 2, v1::POLICY_ROOT);
  for (int mb = 0; mb < 30; ++mb) {
    Plan(0, 0, mb, 1);
    Plan(1, 0, mb, 1);
  }
  EXPECT_EQ(core_->Decisions("job", -1, 1000).decisions_size(), 30);
  core_->OnGoodbye(sessions_[0], "done");
  EXPECT_EQ(core_->Decisions("job", -1, 1000).decisions_size(), 30) << "a live rank: the job goes on";
  core_->OnGoodbye(sessions_[1], "done");
  auto kept = core_->Decisions("job", -1, 1000);
  ASSERT_EQ(kept.decisions_size(), 16);
  EXPECT_EQ(kept.decisions(15).decision().key().microbatch(), 29) << "the newest are kept";
}

TEST_F(CoreTest, RanksOfAllJobsAreCapped) {
  CoordinatorOptions o = options_;
  o.limits.max_total_ranks = 10;
  Reset(o);
  v1::RegisterRequest big = Request(0, 8, 2);
  big.set_job_id("big");
  ASSERT_TRUE(Register(big).ok());
  absl::Status s = Register(Request(0, 4, 2));  // 8 + 4 > 10
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("max_total_ranks is 10"));
  EXPECT_TRUE(Register(Request(0, 2, 2)).ok());  // 8 + 2 fits
}

TEST_F(CoreTest, AJobWhoseRanksNeverComeIsFailedAtTheFormTimeoutAndFreesItsRankSlots) {
  // The probe: four registrations of world 65536 with one live rank each took every rank slot
  // for as long as those ranks lived.
  CoordinatorOptions o = options_;
  o.limits.max_total_ranks = 10;
  o.limits.form_timeout = absl::Seconds(30);
  o.heartbeat_timeout = absl::Hours(1);
  Reset(o);
  v1::RegisterRequest squatter = Request(0, 8, 2);
  squatter.set_job_id("squatter");
  ASSERT_TRUE(Register(squatter).ok());
  EXPECT_EQ(Register(Request(0, 4, 2)).code(), absl::StatusCode::kResourceExhausted);
  clock_->Advance(absl::Seconds(29));
  core_->Tick();
  EXPECT_EQ(core_->Ranks("squatter").ranks(0).state(), v1::RANK_STATE_LIVE) << "within the timeout";
  clock_->Advance(absl::Seconds(2));
  core_->Tick();
  const v1::RankStatus r0 = core_->Ranks("squatter").ranks(0);
  EXPECT_EQ(r0.state(), v1::RANK_STATE_DEAD);
  EXPECT_THAT(r0.dead_reason(), HasSubstr("did not form within form_timeout_ms (30000 ms): 7 of its 8 ranks never "
                                          "registered (1,2,3,4,5,6,7)"));
  EXPECT_TRUE(Register(Request(0, 4, 2)).ok()) << "the ended job makes room";
}

TEST_F(CoreTest, OverTheBudgetTheRanksThatDoNotReadAreCutBiggestFirstAndReadersNever) {
  // The probe: non-readers that kept heartbeating held 121 MiB for as long as they lived; an
  // honest reading job was then cut "for not reading", its own queue empty.
  CoordinatorOptions o = options_;
  o.limits.max_buffered_bytes = 1 << 20;
  o.heartbeat_timeout = absl::Seconds(30);
  Reset(o);
  RegisterAll(4, 2, v1::POLICY_REPLICATE);
  const absl::Time now = clock_->Now();
  core_->buffers()->TakeOver(3 << 20);  // What the queues below hold: over the limit.
  sinks_[1]->backlog_ = {2 << 20, now - absl::Seconds(5)};       // Stuck for 5 s, the biggest.
  sinks_[2]->backlog_ = {1 << 20, now - absl::Seconds(5)};       // Stuck too, smaller.
  sinks_[3]->backlog_ = {4 << 20, now - absl::Milliseconds(10)};  // Reads: its write is fresh.
  for (int r = 0; r < 4; ++r) OnHeartbeat(sessions_[r]);
  core_->Tick();
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_DEAD);
  EXPECT_THAT(RankStatusOf(1).dead_reason(), HasSubstr("2097152 bytes queued for it have waited 5000 ms for it to read "
                                                       "while the daemon's buffers for all clients are over "
                                                       "their limit (max_buffered_bytes 1048576)"));
  EXPECT_TRUE(sinks_[1]->cut);
  EXPECT_EQ(RankStatusOf(3).state(), v1::RANK_STATE_LIVE) << "a rank that reads is never cut for the budget";
  EXPECT_EQ(RankStatusOf(2).state(), v1::RANK_STATE_LIVE) << "one cut brought the total under: no more";
  // Under the limit, a rank that has not read for a heartbeat timeout goes all the same.
  core_->buffers()->Give(3 << 20);
  clock_->Advance(absl::Seconds(26));
  for (int r : {0, 2, 3}) OnHeartbeat(sessions_[r]);
  core_->Tick();
  EXPECT_EQ(RankStatusOf(2).state(), v1::RANK_STATE_DEAD);
  EXPECT_THAT(RankStatusOf(2).dead_reason(), HasSubstr("longer than the heartbeat timeout (30000 ms)"));
  // A pause of the daemon is no rank's: rank 3's write, stuck across it, is not held against it.
  sinks_[3]->backlog_ = {1 << 10, clock_->Now() - absl::Seconds(40)};
  core_->OnPaused(absl::Seconds(40));
  OnHeartbeat(sessions_[3]);
  core_->Tick();
  EXPECT_EQ(RankStatusOf(3).state(), v1::RANK_STATE_LIVE) << "its write waited for the paused daemon";
}

TEST_F(CoreTest, ARankThatStopsReadingIsFailedAndItsGroupToldWhy) {
  RegisterAll(4, 2, v1::POLICY_REPLICATE);
  sinks_[1]->refuse = true;  // Its outgoing queue is full.
  Plan(1, 0, 0, 1);
  core_->Tick();
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_DEAD);
  EXPECT_THAT(RankStatusOf(1).dead_reason(), HasSubstr("not reading its session stream"));
  EXPECT_THAT(RankStatusOf(1).dead_reason(), HasSubstr("test sink refuses")) << "the reason the sink gave";
  auto failures = sinks_[0]->Where([](const auto& m) { return m.has_group_failure(); });
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0].group_failure().reason(), HasSubstr("not reading"));
  // The other group is untouched.
  EXPECT_EQ(RankStatusOf(2).state(), v1::RANK_STATE_LIVE);
  EXPECT_EQ(RankStatusOf(3).state(), v1::RANK_STATE_LIVE);
}

TEST_F(CoreTest, APausedCoordinatorDoesNotDeclareEveryRankDead) {
  RegisterAll();
  // The daemon was stopped for 7 s: no heartbeat was read meanwhile.
  clock_->Advance(absl::Seconds(7));
  core_->OnPaused(absl::Seconds(7));
  core_->Tick();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(RankStatusOf(r).state(), v1::RANK_STATE_LIVE) << "rank " << r;
  // A rank that stays silent after the pause is still declared dead one timeout later.
  clock_->Advance(absl::Milliseconds(1001));
  for (int r : {0, 1, 2}) OnHeartbeat(sessions_[r]);
  core_->Tick();
  EXPECT_EQ(RankStatusOf(3).state(), v1::RANK_STATE_DEAD);
  EXPECT_EQ(RankStatusOf(0).state(), v1::RANK_STATE_LIVE);
}

TEST_F(CoreTest, APauseBetweenTheTickersCheckAndTheTickIsStillAPause) {
  // The chaos run: the ticker checked the gap, was stopped (SIGSTOP of the daemon) while it
  // waited for the core's lock, then ticked with the clock past every heartbeat deadline:
  // 40 ranks declared dead. Tick checks again once it holds the lock.
  RegisterAll();
  const absl::Time decided_to_tick = clock_->Now();
  clock_->Advance(absl::Seconds(6));
  core_->Tick(decided_to_tick);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(RankStatusOf(r).state(), v1::RANK_STATE_LIVE) << "rank " << r;
  // Without the ticker's time (a test's direct call) silence past the timeout is death, as before.
  clock_->Advance(absl::Seconds(6));
  core_->Tick();
  EXPECT_EQ(RankStatusOf(0).state(), v1::RANK_STATE_DEAD);
}

TEST_F(CoreTest, RejectionsOfHugeManifestsStayShort) {
  CoordinatorOptions o = options_;
  o.limits.max_modules = 1000;
  Reset(o);
  v1::RegisterRequest r = Request(0, 1, 1);
  for (int i = 0; i < 900; ++i) r.add_modules()->set_name("module_with_a_long_name_" + std::to_string(i));
  ASSERT_TRUE(Register(r).ok());
  v1::PlanBatch b;
  auto* p = b.add_plans();
  p->mutable_key();  // (0,0)
  (*p->mutable_calls())["vison_tower"] = 1;
  OnPlans(sessions_[0], b);
  auto rej = sinks_[0]->Rejections();
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_THAT(rej[0].message(), HasSubstr("unknown module 'vison_tower'"));
  EXPECT_THAT(rej[0].message(), HasSubstr("(886 more)"));
  EXPECT_LT(rej[0].message().size(), 2000u);
  auto st = core_->Status("job");
  EXPECT_EQ(st.jobs(0).modules_size(), 17);
  // Decisions of such a manifest are big: the answer stops before it outgrows a message.
  for (int mb = 0; mb < 150; ++mb) {
    v1::PlanBatch plan;
    plan.add_plans()->mutable_key()->set_microbatch(mb);
    OnPlans(sessions_[0], plan);
  }
  auto decisions = core_->Decisions("", -1, 200);
  EXPECT_TRUE(decisions.truncated());
  EXPECT_GT(decisions.decisions_size(), 50);
  EXPECT_LT(decisions.ByteSizeLong(), 4u << 20);
}

TEST_F(CoreTest, AManifestWhoseDecisionsCannotBeDeliveredIsRefused) {
  CoordinatorOptions o = options_;
  o.limits.max_modules = 100000;
  Reset(o);
  v1::RegisterRequest r = Request(0, 1, 1);
  for (int i = 0; i < 20000; ++i) r.add_modules()->set_name(std::string(60, 'm') + std::to_string(i));
  absl::Status s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("one decision may be"));
}

// ---------------------------------------------------------------------------------------
// Bundles (a worker's heartbeat, acknowledgements and plans in one message)

TEST_F(CoreTest, ABundleCountsAsHeartbeatAndItsPlansAreDecidedLikeSeparateMessages) {
  RegisterAll();
  Plan(1, 0, 0, 1);
  clock_->Advance(absl::Milliseconds(600));
  v1::WorkerBundle bundle;
  bundle.mutable_heartbeat()->add_memory()->set_module("vision_tower");
  bundle.mutable_heartbeat()->mutable_memory(0)->set_resident_bytes(123);
  auto* p = bundle.mutable_plans()->add_plans();
  p->mutable_key()->set_step(0);
  p->mutable_key()->set_microbatch(0);
  (*p->mutable_calls())["vision_tower"] = 1;
  core_->OnBundle(sessions_[0], FromWire(bundle));
  // Its plan completed the group: both members have the decision.
  ASSERT_EQ(sinks_[0]->Decisions().size(), 1u);
  ASSERT_EQ(sinks_[1]->Decisions().size(), 1u);
  EXPECT_EQ(sinks_[0]->Decisions()[0].SerializeAsString(), sinks_[1]->Decisions()[0].SerializeAsString());
  // Its heartbeat kept rank 0 alive (rank 1 only planned, 600 ms ago, and so did not).
  clock_->Advance(absl::Milliseconds(600));
  OnHeartbeat(sessions_[2]);
  OnHeartbeat(sessions_[3]);
  core_->Tick();
  EXPECT_EQ(RankStatusOf(0).state(), v1::RANK_STATE_LIVE);
  EXPECT_EQ(RankStatusOf(1).state(), v1::RANK_STATE_DEAD);
}

// Cost-aware auto (issue 28): members' cost reports become the group's model (the slowest
// member's numbers), said in one event, and decide the next microbatch.
TEST_F(CoreTest, CostReportsBecomeTheGroupsModelAndDecide) {
  RegisterAll();
  auto report = [&](int rank, double forward, double gather) {
    v1::WorkerBundle bundle;
    auto* c = bundle.mutable_heartbeat()->add_costs();
    c->set_module("vision_tower");
    c->set_forward_seconds_per_call(forward);
    auto* u = c->add_units();
    u->set_unit("whole");
    u->set_gather_bytes(1000);
    u->set_gather_seconds(gather);
    core_->OnBundle(sessions_[rank], FromWire(bundle));
  };
  report(0, 0.010, 0.020);
  report(1, 0.012, 0.015);  // Slower forward, faster gather: the model takes the larger of each.
  int model_events = 0;
  for (const auto& e : core_->Events("job", 0, 100)) {
    if (e.kind() != "group_cost_model") continue;
    ++model_events;
    EXPECT_EQ(e.group(), 0);
  }
  EXPECT_EQ(model_events, 2);  // The second report moved forward by 20 %.
  clock_->Advance(absl::Seconds(5));
  report(1, 0.0121, 0.015);    // Within a tenth: the engine's model stays, no event.
  int after = 0;
  for (const auto& e : core_->Events("job", 0, 100)) after += e.kind() == "group_cost_model";
  EXPECT_EQ(after, 2);
  // Both ranks call the tower twice: gathering once (root) beats gathering per call.
  Plan(0, 0, 0, 2);
  Plan(1, 0, 0, 2);
  ASSERT_EQ(sinks_[0]->Decisions().size(), 1u);
  const v1::ModuleDecision md = sinks_[0]->Decisions()[0].modules(0);  // A copy: Decisions() is a temporary.
  EXPECT_EQ(md.decision(), v1::DECISION_ROOT);
  EXPECT_EQ(md.reason(), v1::REASON_COST);
  bool said = false;
  for (const auto& e : core_->Events("job", 0, 100)) {
    said |= e.kind() == "module_cost_choice" && e.message().find("root 0.0440 s <= per_layer") != std::string::npos;
  }
  EXPECT_TRUE(said);
}

// Issue 28 review: a rerun may bring another manifest; what members measured against the old
// one is dropped (it crashed the daemon: a module name the new manifest lacks), and the
// rerun's reports reach its engine even when they equal the old ones.
TEST_F(CoreTest, ARerunWithAnotherManifestStartsItsCostModelAfresh) {
  auto report = [&](int rank, const std::string& module) {
    v1::WorkerBundle bundle;
    auto* c = bundle.mutable_heartbeat()->add_costs();
    c->set_module(module);
    c->set_forward_seconds_per_call(0.010);
    c->add_units()->set_gather_seconds(0.020);
    core_->OnBundle(sessions_[rank], FromWire(bundle));
  };
  RegisterAll(2, 2);
  report(0, "vision_tower");
  report(1, "vision_tower");
  core_->OnGoodbye(sessions_[0], "done");
  core_->OnGoodbye(sessions_[1], "done");
  for (int rank : {0, 1}) {
    v1::RegisterRequest r = Request(rank, 2, 2);
    r.mutable_modules(0)->set_name("renamed_tower");
    ASSERT_TRUE(Register(r).ok());
  }
  clock_->Advance(absl::Seconds(5));
  report(0, "renamed_tower");  // Rank 1's old report names a module the manifest no longer has.
  report(1, "renamed_tower");
  v1::PlanBatch batch;
  batch.set_epoch(core_->Groups("job").groups(0).epoch());
  auto* p = batch.add_plans();
  p->mutable_key();  // (0,0)
  (*p->mutable_calls())["renamed_tower"] = 2;
  OnPlans(sessions_[0], batch);
  OnPlans(sessions_[1], batch);
  ASSERT_EQ(sinks_[0]->Decisions().size(), 1u);
  EXPECT_EQ(sinks_[0]->Decisions()[0].modules(0).reason(), v1::REASON_COST);
}

TEST_F(CoreTest, CostReportsFasterThanAWorkerSendsAreDroppedAndABudgetDropAppliesAtOnce) {
  v1::RegisterRequest r0 = Request(0, 2, 2), r1 = Request(1, 2, 2);
  r0.set_memory_budget_bytes(10000);
  r1.set_memory_budget_bytes(10000);
  ASSERT_TRUE(Register(r0).ok());
  ASSERT_TRUE(Register(r1).ok());
  auto budget = [&](int rank, int64_t bytes) {
    v1::WorkerBundle bundle;
    bundle.mutable_heartbeat()->set_frozen_budget_bytes(bytes);
    core_->OnBundle(sessions_[rank], FromWire(bundle));
  };
  auto model_events = [&] {
    int n = 0;
    for (const auto& e : core_->Events("job", 0, 1000)) n += e.kind() == "group_cost_model";
    return n;
  };
  budget(0, 9800);
  budget(1, 9900);  // Every member measured: 9800 < 10000 by 2 %, a budget drop: applied.
  EXPECT_EQ(model_events(), 1);
  for (int i = 0; i < 100; ++i) budget(1, i % 2 ? 500 : 9900);  // A hostile flood: dropped.
  EXPECT_EQ(model_events(), 1);
  clock_->Advance(absl::Seconds(5));
  budget(1, 500);
  EXPECT_EQ(model_events(), 2);
  bool said = false;
  for (const auto& e : core_->Events("job", 0, 1000)) {
    said |= e.kind() == "group_cost_model" && e.message().find("budget 500 bytes (registered 10000, 2 of 2") !=
                                                  std::string::npos;
  }
  EXPECT_TRUE(said);
}

TEST_F(CoreTest, HostileCostReportsAreBoundedAndBadNumbersDropped) {
  RegisterAll();
  v1::WorkerBundle bundle;
  for (const char* module : {"vision_tower", "vision_tower", "not_in_manifest"}) {
    auto* c = bundle.mutable_heartbeat()->add_costs();
    c->set_module(module);
    c->set_forward_seconds_per_call(std::nan(""));
    for (int i = 0; i < 1000; ++i) {
      auto* u = c->add_units();
      u->set_unit("u" + std::to_string(i));
      u->set_gather_seconds(i == 0 ? 1e12 : -1);  // An absurd time, then negative ones.
    }
  }
  core_->OnBundle(sessions_[0], FromWire(bundle));
  // Nothing usable was reported: no model, the counting rule decides.
  for (const auto& e : core_->Events("job", 0, 100)) EXPECT_NE(e.kind(), "group_cost_model") << e.message();
  Plan(0, 0, 0, 2);
  Plan(1, 0, 0, 2);
  ASSERT_EQ(sinks_[0]->Decisions().size(), 1u);
  EXPECT_EQ(sinks_[0]->Decisions()[0].modules(0).decision(), v1::DECISION_PER_LAYER);
}

TEST_F(CoreTest, MemoryReportsKeepOneEntryPerModuleOfTheManifest) {
  // Issue 25: 20 heartbeats of 3.9 MB took RSS from 20 to 598 MB. Only what the manifest
  // names is kept: a rank's reports cost no more than its share of the job's manifest.
  RegisterAll();
  v1::WorkerBundle bundle;
  auto add = [&](const std::string& module, int64_t bytes) {
    auto* e = bundle.mutable_heartbeat()->add_memory();
    e->set_module(module);
    e->set_resident_bytes(bytes);
  };
  add("vision_tower", 1);
  for (int i = 0; i < 5000; ++i) add(absl::StrCat("junk_", i, std::string(200, 'x')), 7);
  add("vision_tower", 2);   // A second entry for one module: the first stays.
  add("audio_tower", -5);   // Negative: dropped.
  core_->OnBundle(sessions_[0], FromWire(bundle));
  const auto ranks = core_->Ranks("job");
  ASSERT_EQ(ranks.ranks(0).memory_size(), 1) << ranks.ranks(0).DebugString();
  EXPECT_EQ(ranks.ranks(0).memory(0).module(), "vision_tower");
  EXPECT_EQ(ranks.ranks(0).memory(0).resident_bytes(), 1);
}

TEST_F(CoreTest, APlanBatchLargerThanTheLookaheadWindowCutsTheRankNamingWhy) {
  RegisterAll();  // lookahead 4: at most 2 x 4 + 16 plans a batch
  v1::PlanBatch batch;
  for (int mb = 0; mb < 25; ++mb) {
    auto* p = batch.add_plans();
    p->mutable_key()->set_microbatch(mb);
    (*p->mutable_calls())["vision_tower"] = 1;
  }
  OnPlans(sessions_[0], batch);
  EXPECT_TRUE(sinks_[0]->Rejections().empty()) << "no rejection per plan: the batch is refused whole";
  core_->Tick();
  EXPECT_EQ(RankStatusOf(0).state(), v1::RANK_STATE_DEAD);
  EXPECT_THAT(RankStatusOf(0).dead_reason(),
              HasSubstr("broke the protocol: sent 25 plans in one batch; with a lookahead window of 4 a worker "
                        "sends at most 24"));
  auto failures = sinks_[1]->Where([](const auto& m) { return m.has_group_failure(); });
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0].group_failure().reason(), HasSubstr("broke the protocol"));
}

TEST_F(CoreTest, ABundleOfABadPlanIsRejectedLikeOneAlone) {
  RegisterAll();
  v1::WorkerBundle bundle;
  auto* p = bundle.mutable_plans()->add_plans();
  p->mutable_key()->set_step(0);
  p->mutable_key()->set_microbatch(0);
  (*p->mutable_calls())["no_such_tower"] = 1;
  core_->OnBundle(sessions_[0], FromWire(bundle));
  ASSERT_EQ(sinks_[0]->Rejections().size(), 1u);
  EXPECT_THAT(sinks_[0]->Rejections()[0].message(), HasSubstr("no_such_tower"));
  // An empty bundle and one for a stale session change nothing.
  core_->OnBundle(sessions_[0], FromWire(v1::WorkerBundle()));
  core_->OnBundle(987654, FromWire(bundle));
  EXPECT_EQ(sinks_[0]->Rejections().size(), 1u);
}

// ---------------------------------------------------------------------------------------
// Parallel groups (DESIGN 9: plans take the core's lock shared plus their group's own)

TEST_F(CoreTest, PlansFromManyThreadsAreDecidedOnceAndIdenticallyForEveryMember) {
  constexpr int kWorld = 64, kGroupSize = 4, kMicrobatches = 48, kThreads = 8;
  CoordinatorOptions o = options_;
  o.max_lookahead = kMicrobatches;
  Reset(o);
  for (int r = 0; r < kWorld; ++r) {
    v1::RegisterRequest req = Request(r, kWorld, kGroupSize);
    req.set_lookahead(kMicrobatches);  // No plan is refused for running ahead of its group.
    ASSERT_TRUE(Register(req).ok());
  }
  // Every rank of a group is planned by a different thread; meanwhile operators query and
  // the ticker runs (both take the lock exclusively).
  std::atomic<bool> done{false};
  std::thread observer([&] {
    while (!done.load()) {
      core_->Tick();
      (void)core_->Status("job");
      (void)core_->Decisions("job", 0, 4);
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int mb = 0; mb < kMicrobatches; ++mb) {
        for (int r = t; r < kWorld; r += kThreads) {
          v1::PlanBatch batch;  // Epoch 0: no group re-formed.
          auto* p = batch.add_plans();
          p->mutable_key()->set_step(mb / 4);
          p->mutable_key()->set_microbatch(mb % 4);
          (*p->mutable_calls())["vision_tower"] = (mb + r) % 3 == 0 ? 1 : 0;  // Divergent now and then.
          (*p->mutable_calls())["audio_tower"] = 0;
          if (mb % 2 == 0) {
            OnPlans(sessions_[r], batch);
          } else {
            v1::WorkerBundle bundle;
            bundle.mutable_heartbeat()->set_sent_unix_ms(1);
            *bundle.mutable_plans() = batch;
            core_->OnBundle(sessions_[r], FromWire(bundle));
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  done.store(true);
  observer.join();

  for (int g = 0; g < kWorld / kGroupSize; ++g) {
    const auto first = sinks_[g * kGroupSize]->Decisions();
    ASSERT_EQ(first.size(), static_cast<size_t>(kMicrobatches)) << "group " << g;
    for (int i = 1; i < kGroupSize; ++i) {
      const auto other = sinks_[g * kGroupSize + i]->Decisions();
      ASSERT_EQ(other.size(), first.size()) << "rank " << g * kGroupSize + i;
      for (size_t k = 0; k < first.size(); ++k) {
        EXPECT_EQ(other[k].SerializeAsString(), first[k].SerializeAsString())
            << "rank " << g * kGroupSize + i << " microbatch " << k;
      }
    }
    for (int i = 0; i < kGroupSize; ++i) EXPECT_TRUE(sinks_[g * kGroupSize + i]->Rejections().empty());
  }
  const v1::StatusResponse status = core_->Status("job");
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).plans_received(), kWorld * kMicrobatches);
  EXPECT_EQ(status.jobs(0).microbatches_decided(), kWorld / kGroupSize * kMicrobatches);
}

}  // namespace
}  // namespace shardcoord::coordinator
