// Unit tests of coordinator recovery after a restart (DESIGN 12): the pure rule
// (coordinator/recovery.h) and CoordinatorCore rebuilding groups from resuming ranks, with
// recording sinks and a fake clock.
#include <gmock/gmock.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <gtest/gtest.h>

#include "coordinator/core/coordinator_core.h"
#include "coordinator/engine/recovery.h"
#include "coordinator/core/registration.h"
#include "coordinator/daemon/state_file.h"
#include "support/test_env.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <limits>

#include "coordinator/core/resume_auth.h"
#include "coordinator/core/run_pins.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "shardcoord/decide.h"
#include "shardcoord/proto/convert.h"
#include "support/core_fakes.h"

namespace shardcoord::coordinator {
namespace {

using ::testing::HasSubstr;

v1::MicrobatchDecision Decision(int64_t step, int mb, uint64_t seq, v1::Decision d,
                                v1::DecisionReason reason = v1::REASON_UNIFORM) {
  v1::MicrobatchDecision out;
  out.set_group(0);
  out.mutable_key()->set_step(step);
  out.mutable_key()->set_microbatch(mb);
  out.set_seq(seq);
  out.set_epoch(0);
  auto* m = out.add_modules();
  m->set_module("vision");
  m->set_decision(d);
  m->set_reason(reason);
  out.set_digest(DecisionDigest(FromProto(out)));  // As the coordinator computed it.
  return out;
}

v1::MicrobatchPlan Plan(int64_t step, int mb, int calls) {
  v1::MicrobatchPlan p;
  p.mutable_key()->set_step(step);
  p.mutable_key()->set_microbatch(mb);
  (*p.mutable_calls())["vision"] = calls;
  return p;
}

TEST(PlanGroupRecoveryTest, HeldDecisionsAreBindingAndGoToMembersThatPlannedButLackThem) {
  MemberResume a{0, {}}, b{1, {}};
  *a.state.add_held() = Decision(0, 0, 0, v1::DECISION_PER_LAYER);
  *a.state.add_held() = Decision(0, 1, 1, v1::DECISION_SKIP);
  *b.state.add_held() = Decision(0, 0, 0, v1::DECISION_PER_LAYER);
  *b.state.add_undecided() = Plan(0, 1, 0);  // Rank 1 never received (0,1).
  *a.state.add_undecided() = Plan(0, 2, 1);
  *b.state.add_undecided() = Plan(0, 2, 1);
  GroupRecovery r = PlanGroupRecovery(0, {a, b});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.binding.size(), 2u);
  ASSERT_EQ(r.resend.size(), 1u);
  EXPECT_EQ(r.resend[0].first, 1);
  EXPECT_EQ(r.resend[0].second.seq(), 1u) << "re-sent unchanged";
  ASSERT_EQ(r.undecided.size(), 2u) << "(0,2) is held by nobody: decided afresh from both plans";
  EXPECT_EQ(r.next_seq, 2u);
  EXPECT_TRUE(r.lost.empty());
}

TEST(PlanGroupRecoveryTest, TwoDifferentHeldDecisionsForOneKeyAreDetectedNamingTheRanks) {
  MemberResume a{4, {}}, b{5, {}}, c{6, {}};
  *a.state.add_held() = Decision(3, 1, 7, v1::DECISION_PER_LAYER);
  *b.state.add_held() = Decision(3, 1, 7, v1::DECISION_PER_LAYER);
  *c.state.add_held() = Decision(3, 1, 7, v1::DECISION_ROOT, v1::REASON_DIVERGENT);
  GroupRecovery r = PlanGroupRecovery(1, {a, b, c});
  ASSERT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status.message(), HasSubstr("contradictory decisions for microbatch (3,1)"));
  EXPECT_THAT(r.status.message(), HasSubstr("ranks 4,5 hold"));
  EXPECT_THAT(r.status.message(), HasSubstr("rank 6 holds"));
  EXPECT_THAT(r.status.message(), HasSubstr("vision=DECISION_ROOT"));
}

TEST(PlanGroupRecoveryTest, MembersInDifferentEpochsCannotResume) {
  MemberResume a{0, {}}, b{1, {}};
  a.state.set_group_epoch(2);
  b.state.set_group_epoch(1);
  GroupRecovery r = PlanGroupRecovery(0, {a, b});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status.message(), HasSubstr("ranks 1 at epoch 1; ranks 0 at epoch 2"));
}

TEST(PlanGroupRecoveryTest, PromotionsAreRebuiltFromTheNewestDecisionAndLostKeysNamed) {
  MemberResume a{0, {}}, b{1, {}};
  *a.state.add_held() = Decision(0, 0, 4, v1::DECISION_PER_LAYER);
  *a.state.add_held() = Decision(0, 3, 7, v1::DECISION_REPLICATE, v1::REASON_PROMOTED);
  *b.state.add_held() = Decision(0, 3, 7, v1::DECISION_REPLICATE, v1::REASON_PROMOTED);
  *b.state.add_undecided() = Plan(0, 1, 1);  // Older than the newest held key, held by nobody.
  GroupRecovery r = PlanGroupRecovery(0, {a, b});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.promoted, ::testing::ElementsAre("vision"));
  EXPECT_EQ(r.next_seq, 8u);
  ASSERT_EQ(r.lost.size(), 1u);
  EXPECT_EQ(r.lost[0].first, 1);
}

// ---------------------------------------------------------------------------------------
// Through the core

// The run of "job" that the resumes below come from (RegisterResponse.run_id).
constexpr char kRun[] = "0123456789abcdef0123456789abcdef";

CoordinatorOptions RecoveryOptions() {
  CoordinatorOptions o;
  o.heartbeat_interval = absl::Milliseconds(100);
  o.heartbeat_timeout = absl::Seconds(10);
  o.recovery_window = absl::Seconds(5);
  o.incarnation = 1000;
  return o;
}

class CoreRecoveryTest : public ::testing::Test, protected shardcoord::testing::CoreHarness {
 protected:
  explicit CoreRecoveryTest(const CoordinatorOptions& options = RecoveryOptions()) : CoreHarness(options) {}

  v1::RegisterRequest Request(int rank, v1::Policy policy = v1::POLICY_AUTO) {
    v1::RegisterRequest r;
    r.set_job_id("job");
    r.set_wire_revision(shardcoord::kWireRevision);
    r.set_rank(rank);
    r.set_world_size(2);
    r.set_group_size(2);
    r.set_policy(policy);
    r.set_fallback(v1::FALLBACK_ROOT);
    r.set_wrap_outer_model(true);
    r.set_lookahead(4);
    auto* m = r.add_modules();
    m->set_name("vision");
    m->set_param_bytes(100);
    return r;
  }

  // A resume from incarnation 900, registered under the same settings this core gives.
  v1::RegisterRequest Resume(int rank, v1::Policy policy = v1::POLICY_AUTO) {
    v1::RegisterRequest r = Request(rank, policy);
    v1::ResumeState* s = r.mutable_resume();
    s->set_incarnation(900);
    s->set_group_epoch(0);
    v1::RegisterResponse* prev = s->mutable_previous();
    prev->set_group(0);
    prev->set_policy(policy);
    prev->set_fallback(v1::FALLBACK_ROOT);
    prev->set_lookahead(4);
    prev->set_config_digest(core_->config_digest());
    prev->set_run_id(kRun);
    return r;
  }

  void SendPlan(int rank, int64_t step, int mb, int calls, int64_t epoch = 0) {
    v1::PlanBatch batch;
    *batch.add_plans() = Plan(step, mb, calls);
    batch.set_epoch(epoch);
    OnPlans(sessions_[rank], batch);
  }
};

TEST_F(CoreRecoveryTest, AHeldDecisionIsResentUnchangedAndNewKeysWaitForEveryMember) {
  v1::RegisterRequest r0 = Resume(0), r1 = Resume(1);
  *r0.mutable_resume()->add_held() = Decision(5, 0, 9, v1::DECISION_PER_LAYER);
  *r1.mutable_resume()->add_undecided() = Plan(5, 0, 1);  // Lost in the crash.
  *r0.mutable_resume()->add_undecided() = Plan(5, 1, 1);
  ASSERT_TRUE(Register(r0).ok());
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_RECOVERING);
  EXPECT_EQ(core_->Status("").recovering_groups(), 1);
  SendPlan(0, 5, 2, 1);  // Planned after resuming: waits too.
  EXPECT_TRUE(sinks_[0]->Decisions().empty()) << "nothing is decided while a member is missing";
  ASSERT_TRUE(Register(r1).ok());
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_HEALTHY);
  auto d1 = sinks_[1]->Decisions();
  ASSERT_GE(d1.size(), 1u);
  EXPECT_EQ(d1[0].key().step(), 5);
  EXPECT_EQ(d1[0].seq(), 9u);
  EXPECT_EQ(d1[0].digest(), Decision(5, 0, 9, v1::DECISION_PER_LAYER).digest()) << "the held decision, unchanged";
  // (5,1) and (5,2): rank 1 has not planned them; once it does, both are decided with seq 10, 11.
  SendPlan(1, 5, 1, 1);
  SendPlan(1, 5, 2, 1);
  auto d0 = sinks_[0]->Decisions();
  ASSERT_EQ(d0.size(), 2u);
  EXPECT_EQ(d0[0].seq(), 10u) << "seq goes on after the highest held one";
  EXPECT_EQ(d0[1].seq(), 11u);
  EXPECT_EQ(sinks_[1]->Decisions().back().digest(), d0[1].digest());
  EXPECT_GT(core_->Status("").incarnation(), 0u);
}

TEST_F(CoreRecoveryTest, ContradictoryHeldDecisionsFailTheGroupNamingTheRanks) {
  v1::RegisterRequest r0 = Resume(0), r1 = Resume(1);
  *r0.mutable_resume()->add_held() = Decision(1, 0, 3, v1::DECISION_PER_LAYER);
  *r1.mutable_resume()->add_held() = Decision(1, 0, 3, v1::DECISION_SKIP);
  ASSERT_TRUE(Register(r0).ok());
  ASSERT_TRUE(Register(r1).ok());
  for (int r : {0, 1}) {
    auto failures = sinks_[r]->Where([](const auto& m) { return m.has_group_failure(); });
    ASSERT_EQ(failures.size(), 1u) << "rank " << r;
    EXPECT_THAT(failures[0].group_failure().reason(), HasSubstr("contradictory decisions for microbatch (1,0)"));
    EXPECT_THAT(failures[0].group_failure().reason(), HasSubstr("rank 1 holds"));
  }
  EXPECT_EQ(core_->Groups("job").groups(0).epoch(), 1) << "re-formed in a new epoch";
}

TEST_F(CoreRecoveryTest, AMemberThatDoesNotResumeWithinTheWindowIsDeclaredDeadByName) {
  ASSERT_TRUE(Register(Resume(0)).ok());
  clock_->Advance(absl::Seconds(4));
  OnHeartbeat(sessions_[0]);
  core_->Tick();
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_RECOVERING);
  clock_->Advance(absl::Seconds(2));
  OnHeartbeat(sessions_[0]);
  core_->Tick();
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FAILED);
  auto failures = sinks_[0]->Where([](const auto& m) { return m.has_group_failure(); });
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0].group_failure().reason(), HasSubstr("1 of 2 ranks (1) did not resume within the recovery window"));
}

TEST_F(CoreRecoveryTest, WithoutAKeyAnUnverifiableResumeIsTakenOnlySoonAfterAStart) {
  // No --state-file, no tokens: a resume cannot be checked, so it is believed only while a
  // restart's honest resumes can still arrive (within the recovery window of the start).
  clock_->Advance(absl::Seconds(6));
  absl::Status s = Register(Resume(0));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("resumes from an earlier coordinator 6 s after this one started"));
  EXPECT_TRUE(core_->Status("").jobs().empty()) << "nothing was created";
}

TEST_F(CoreRecoveryTest, AJobWhoseRanksAllLeftRunsAgainUnderTheSameIdFromTheFirstKey) {
  for (int run = 0; run < 2; ++run) {
    ASSERT_TRUE(Register(Request(0)).ok()) << "run " << run;
    ASSERT_TRUE(Register(Request(1)).ok()) << "run " << run;
    const int64_t epoch = core_->Groups("job").groups(0).epoch();  // As the workers are told.
    for (int mb = 0; mb < 3; ++mb) {
      SendPlan(0, 0, mb, 1, epoch);
      SendPlan(1, 0, mb, 1, epoch);
    }
    auto decided = sinks_[0]->Decisions();
    ASSERT_EQ(decided.size(), 3u) << "run " << run << ": every key of the run decided, none stale";
    EXPECT_EQ(decided[0].key().step(), 0);
    EXPECT_TRUE(sinks_[0]->Where([](const auto& m) { return m.has_plan_rejected(); }).empty()) << "run " << run;
    core_->OnGoodbye(sessions_[0], "done");
    core_->OnGoodbye(sessions_[1], "done");
  }
}

TEST_F(CoreRecoveryTest, AnExpiredRecoveryOfALargeGroupWritesOneShortEvent) {
  // One resume for a one-group job of 16,384 ranks: when the window expires, 16,383 ranks are
  // missing. Each used to get its own event listing all of them (1.4 GB of log).
  constexpr int kWorld = 16384;
  v1::RegisterRequest r = Resume(0);
  r.set_world_size(kWorld);
  r.set_group_size(kWorld);
  ASSERT_TRUE(Register(r).ok());
  clock_->Advance(absl::Seconds(6));
  OnHeartbeat(sessions_[0]);
  core_->Tick();
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FAILED);
  size_t bytes = 0;
  int expired = 0, dead_events = 0;
  for (const v1::Event& e : core_->Events("job", 0, 100000)) {
    bytes += e.message().size();
    expired += e.kind() == "recovery_expired";
    dead_events += e.kind() == "rank_dead";
  }
  EXPECT_EQ(expired, 1);
  EXPECT_EQ(dead_events, 0);
  EXPECT_LT(bytes, 16 * 1024) << "event text must not grow with the group";
  auto failures = sinks_[0]->Where([](const auto& m) { return m.has_group_failure(); });
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0].group_failure().reason(), HasSubstr("16383 of 16384 ranks (1,2,3,"));
  EXPECT_THAT(failures[0].group_failure().reason(), HasSubstr(",... (16351 more)) did not resume"));
  EXPECT_LT(failures[0].group_failure().reason().size(), 1024u);
}

TEST_F(CoreRecoveryTest, ChangedSettingsOrAnOlderIncarnationAreRefused) {
  v1::RegisterRequest changed = Resume(0);
  changed.mutable_resume()->mutable_previous()->set_policy(v1::POLICY_PER_LAYER);
  changed.mutable_resume()->mutable_previous()->set_config_digest(1);
  absl::Status s = Register(changed);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("policy per_layer -> auto"));
  EXPECT_THAT(s.message(), HasSubstr("auto promotion settings"));
  EXPECT_THAT(s.message(), HasSubstr("restart shardcoordd with the settings the job started under"));
  v1::RegisterRequest newer = Resume(0);
  newer.mutable_resume()->set_incarnation(5000);
  s = Register(newer);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("not older than this coordinator's"));
  EXPECT_TRUE(core_->Groups("job").groups().empty()) << "a refused resume changes nothing";
}

TEST_F(CoreRecoveryTest, StaticPoliciesHandOutTheHeldDecisionToAMemberThatReportsItLater) {
  v1::RegisterRequest r0 = Resume(0, v1::POLICY_ROOT), r1 = Resume(1, v1::POLICY_ROOT);
  *r0.mutable_resume()->add_held() = Decision(2, 0, 6, v1::DECISION_ROOT, v1::REASON_STATIC_POLICY);
  ASSERT_TRUE(Register(r0).ok());
  ASSERT_TRUE(Register(r1).ok());
  SendPlan(1, 2, 0, 1);  // Rank 1 was behind: it reports (2,0) only now.
  auto d1 = sinks_[1]->Decisions();
  ASSERT_EQ(d1.size(), 1u);
  EXPECT_EQ(d1[0].seq(), 6u);
  EXPECT_EQ(d1[0].digest(), Decision(2, 0, 6, v1::DECISION_ROOT, v1::REASON_STATIC_POLICY).digest());
  SendPlan(1, 2, 1, 1);
  EXPECT_EQ(sinks_[1]->Decisions().back().seq(), 7u);
}

TEST(StateFileTest, IncarnationsKeepIncreasingAndABadFileIsIgnored) {
  shardcoord::testing::TempDir dir;
  const std::string path = dir.File("state");
  const absl::Time now = absl::FromUnixSeconds(1'800'000'000);
  EXPECT_EQ(ReadIncarnation(path).status().code(), absl::StatusCode::kNotFound);
  const uint64_t first = NextIncarnation(path, now);
  EXPECT_EQ(first, static_cast<uint64_t>(absl::ToUnixMicros(now)));
  ASSERT_TRUE(ReadIncarnation(path).ok());
  EXPECT_EQ(*ReadIncarnation(path), first);
  // The clock stepped back an hour: the file keeps the next start larger.
  EXPECT_EQ(NextIncarnation(path, now - absl::Hours(1)), first + 1);
  // Truncated, edited or foreign files are detected, ignored, and rewritten.
  for (const std::string bad : {"", "shardcoordd-state 1\nincarnation 12\ncheck 1\n", "garbage\n",
                                "shardcoordd-state 1\nincarnation x\n"}) {
    std::ofstream(path, std::ios::trunc) << bad;
    EXPECT_EQ(ReadIncarnation(path).status().code(), absl::StatusCode::kDataLoss) << bad;
    EXPECT_EQ(NextIncarnation(path, now + absl::Seconds(1)), static_cast<uint64_t>(absl::ToUnixMicros(now)) + 1000000);
    EXPECT_TRUE(ReadIncarnation(path).ok()) << "rewritten after " << bad;
  }
  // A well-formed file near 2^64 (forged, or a corrupt clock) would wrap the incarnation to 0
  // a few starts later: ignored, the clock is taken.
  ASSERT_TRUE(WriteIncarnation(path, std::numeric_limits<uint64_t>::max()).ok());
  EXPECT_EQ(NextIncarnation(path, now), static_cast<uint64_t>(absl::ToUnixMicros(now)));
}

}  // namespace
}  // namespace shardcoord::coordinator

// ---------------------------------------------------------------------------------------
// Resumes that prove themselves (resume_auth.h): a forged resume is refused

namespace shardcoord::coordinator {
namespace {

const std::string kResumeKey(32, 'k');

CoordinatorOptions SmallBuffersOptions() {
  CoordinatorOptions o = RecoveryOptions();
  o.limits.max_buffered_bytes = 1 << 20;
  return o;
}

class BufferedRecoveryTest : public CoreRecoveryTest {
 protected:
  BufferedRecoveryTest() : CoreRecoveryTest(SmallBuffersOptions()) {}
};

TEST_F(BufferedRecoveryTest, AResumeTheDaemonsBuffersCannotHoldIsRefusedAndHeldOnesAreGivenBack) {
  // Issue 25: a 4 MB resume cost about 120 MB for the whole recovery window; resumes are
  // now charged to max_buffered_bytes while they wait for their group.
  v1::RegisterRequest big = Resume(0);
  for (int mb = 0; mb < 20000; ++mb) *big.mutable_resume()->add_undecided() = Plan(1, mb, 1);
  absl::Status s = Register(big);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("max_buffered_bytes 1048576"));
  EXPECT_TRUE(core_->Status("").jobs().empty()) << "nothing was created";
  EXPECT_EQ(core_->buffers()->used(), 0);
  // Honest resumes fit; what they hold is charged until the group recovers, then given back.
  ASSERT_TRUE(Register(Resume(0)).ok());
  EXPECT_GT(core_->buffers()->used(), 0);
  ASSERT_TRUE(Register(Resume(1)).ok());
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_HEALTHY);
  EXPECT_EQ(core_->buffers()->used(), 0);
}

TEST_F(BufferedRecoveryTest, AResumeLeftToExpireGivesItsBytesBack) {
  ASSERT_TRUE(Register(Resume(0)).ok());
  EXPECT_GT(core_->buffers()->used(), 0);
  clock_->Advance(absl::Seconds(6));
  OnHeartbeat(sessions_[0]);
  core_->Tick();
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FAILED);
  EXPECT_EQ(core_->buffers()->used(), 0);
}

TEST_F(BufferedRecoveryTest, AGroupFailingWhileItRecoversGivesItsResumesBack) {
  // Review: a death during recovery failed the group, and the resumes already held stayed
  // charged for the life of the job.
  ASSERT_TRUE(Register(Resume(0)).ok());
  ASSERT_GT(core_->buffers()->used(), 0);
  core_->OnSessionClosed(sessions_[0], "killed");
  EXPECT_NE(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_RECOVERING);
  EXPECT_EQ(core_->buffers()->used(), 0);
}

TEST(BufferBudgetTest, ShortQueuesAreNeverRefusedAndTheBiggestHoldersArePastTheLimit) {
  BufferBudget budget(1000);
  EXPECT_TRUE(budget.TryTake(900, 0));
  EXPECT_TRUE(budget.TryTake(500, 0)) << "a holder of under 64 KiB is served past the limit";
  EXPECT_FALSE(budget.TryTake(100, BufferBudget::kSmallHolder)) << "a big holder past the limit is refused";
  EXPECT_EQ(budget.used(), 1400) << "a refusal takes nothing";
  EXPECT_FALSE(budget.TryTakeStrict(1)) << "resumes are never exempt";
  {
    BufferCharge charge(&budget, 400);
    BufferCharge moved = std::move(charge);
  }
  EXPECT_EQ(budget.used(), 1000) << "a charge gives back once, when its last owner goes";
  budget.Give(1000);
  EXPECT_TRUE(budget.TryTakeStrict(1000));
}

CoordinatorOptions KeyedOptions() {
  CoordinatorOptions o = RecoveryOptions();
  o.resume_key = kResumeKey;  // As a daemon with a state file (or tokens) has: it outlives the process.
  return o;
}

// Decision(...) sealed by `auth` (the daemon before the restart, or a forger's key).
v1::MicrobatchDecision HeldDecision(int64_t step, int mb, uint64_t seq, v1::Decision kind,
                                    const ResumeAuthority* auth) {
  v1::MicrobatchDecision d =
      Decision(step, mb, seq, kind, kind == v1::DECISION_SKIP ? v1::REASON_ALL_SKIP : v1::REASON_UNIFORM);
  d.set_seal(auth->ForRun("job", kRun).Seal("job", d));
  return d;
}

class KeyedRecoveryTest : public CoreRecoveryTest {
 protected:
  KeyedRecoveryTest() : CoreRecoveryTest(KeyedOptions()) {}

  // What a rank registered with an earlier daemon of the same key holds: its registration
  // `serial` (10 + rank unless said) of incarnation 900 in run kRun.
  v1::RegisterRequest Resume(int rank, bool with_credential, uint64_t serial = 0) {
    v1::RegisterRequest r = CoreRecoveryTest::Resume(rank);
    if (with_credential) Prove(r, earlier_, kRun, serial != 0 ? serial : 10 + rank);
    return r;
  }
  // Signs `r`'s resume as registration `serial` of incarnation 900 of `run`, with `auth`'s key.
  static void Prove(v1::RegisterRequest& r, const ResumeAuthority& auth, const std::string& run, uint64_t serial) {
    r.mutable_resume()->mutable_previous()->set_run_id(run);
    r.mutable_resume()->mutable_previous()->set_registration(serial);
    r.mutable_resume()->set_credential(auth.ForRun("job", run).Credential("job", r.rank(), 900, serial));
  }

  const ResumeAuthority earlier_{kResumeKey, true};  // The daemon before the restart.
  const ResumeAuthority forger_ = ResumeAuthority::Ephemeral();
};

TEST_F(KeyedRecoveryTest, AResumeWithoutItsRanksCredentialIsRefusedAndChangesNothing) {
  v1::RegisterRequest forged = Resume(1, /*with_credential=*/false);
  *forged.mutable_resume()->add_held() = HeldDecision(0, 0, 0, v1::DECISION_PER_LAYER, &forger_);
  absl::Status s = Register(forged);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("carries no valid resume credential"));
  // Another rank's credential does not do either.
  forged.mutable_resume()->set_credential(earlier_.ForRun("job", kRun).Credential("job", 0, 900, 0));
  EXPECT_EQ(Register(forged).code(), absl::StatusCode::kPermissionDenied);
  forged.mutable_resume()->set_credential(earlier_.ForRun("other-job", kRun).Credential("other-job", 1, 900, 0));
  EXPECT_EQ(Register(forged).code(), absl::StatusCode::kPermissionDenied);
  // Nothing started: the honest rank 1 registers as usual.
  v1::RegisterRequest honest = Resume(1, true);
  honest.clear_resume();
  EXPECT_TRUE(Register(honest).ok());
}

TEST_F(KeyedRecoveryTest, AHeldDecisionTheCoordinatorDidNotMakeIsRefused) {
  v1::RegisterRequest r = Resume(0, /*with_credential=*/true);
  *r.mutable_resume()->add_held() = HeldDecision(0, 0, 0, v1::DECISION_SKIP, &earlier_);
  *r.mutable_resume()->add_held() = HeldDecision(0, 1, 1, v1::DECISION_PER_LAYER, &forger_);
  absl::Status s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("decision for (0,1) seq 1 that no coordinator with this resume key made"));
  // A sealed decision whose value was changed after sealing fails the same way.
  v1::MicrobatchDecision changed = HeldDecision(0, 1, 1, v1::DECISION_SKIP, &earlier_);
  changed.mutable_modules(0)->set_decision(v1::DECISION_PER_LAYER);
  changed.mutable_modules(0)->set_reason(v1::REASON_UNIFORM);
  changed.set_digest(DecisionDigest(FromProto(changed)));
  r.mutable_resume()->mutable_held(1)->CopyFrom(changed);
  EXPECT_EQ(Register(r).code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(KeyedRecoveryTest, APaddedDecisionsPassesAreSealed) {
  v1::RegisterRequest r = Resume(0, /*with_credential=*/true);
  v1::MicrobatchDecision padded = Decision(0, 0, 0, v1::DECISION_PADDED, v1::REASON_DIVERGENT);
  padded.mutable_modules(0)->set_calls(2);
  padded.set_digest(DecisionDigest(FromProto(padded)));
  padded.set_seal(earlier_.ForRun("job", kRun).Seal("job", padded));
  // A forged pass count (digest recomputed to match) would make the honest ranks gather a
  // different number of times: the seal refuses it.
  v1::MicrobatchDecision forged = padded;
  forged.mutable_modules(0)->set_calls(3);
  forged.set_digest(DecisionDigest(FromProto(forged)));
  *r.mutable_resume()->add_held() = forged;
  absl::Status s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  r.mutable_resume()->mutable_held(0)->CopyFrom(padded);
  EXPECT_TRUE(Register(r).ok()) << "the sealed original is taken";
}

TEST_F(KeyedRecoveryTest, AnHonestResumeWithSealedDecisionsIsTaken) {
  v1::RegisterRequest r = Resume(0, /*with_credential=*/true);
  *r.mutable_resume()->add_held() = HeldDecision(0, 0, 0, v1::DECISION_PER_LAYER, &earlier_);
  ASSERT_TRUE(Register(r).ok());
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_RECOVERING);
  auto registered = sinks_[0]->Where([](const auto& m) { return m.has_registered(); });
  ASSERT_EQ(registered.size(), 1u);
  const v1::RegisterResponse& answer = registered[0].registered();
  EXPECT_GT(answer.registration(), 0u);
  EXPECT_EQ(answer.resume_credential(), earlier_.ForRun("job", kRun).Credential("job", 0, 1000, answer.registration()))
      << "a credential of this registration, in the same run's key";
  EXPECT_EQ(registered[0].registered().run_id(), kRun) << "the run goes on";
}

TEST_F(KeyedRecoveryTest, FieldsOutsideTheirRangesAreRefusedNamingTheField) {
  struct Case {
    void (*mutate)(v1::ResumeState&);
    std::string says;
  };
  const Case cases[] = {
      {[](auto& s) { s.set_group_epoch(std::numeric_limits<int64_t>::max()); }, "outside 0..2^40"},
      {[](auto& s) { s.mutable_held(0)->set_seq(std::numeric_limits<uint64_t>::max()); }, "beyond 2^62"},
      {[](auto& s) { s.mutable_held(0)->mutable_modules(0)->set_decision(static_cast<v1::Decision>(77)); },
       "decision 77"},
      {[](auto& s) { s.mutable_held(0)->mutable_modules(0)->set_module("audio"); }, "names module 'audio'"},
      {[](auto& s) { s.mutable_held(0)->clear_modules(); }, "0 module entries, the manifest 1"},
      {[](auto& s) { s.mutable_held(0)->set_digest(0xdeadbeef); }, "digest does not match"},
      {[](auto& s) { s.mutable_held(0)->set_group(3); }, "for group 3"},
      {[](auto& s) { s.mutable_held(0)->set_epoch(5); }, "epoch 5 is not 0"},
      {[](auto& s) { s.mutable_held(0)->mutable_modules(0)->set_calls(3); }, "DECISION_ROOT with 3 passes"},
  };
  for (const Case& c : cases) {
    v1::RegisterRequest r = Resume(0, true);
    *r.mutable_resume()->add_held() = HeldDecision(0, 0, 0, v1::DECISION_ROOT, &earlier_);
    c.mutate(*r.mutable_resume());
    absl::Status s = Register(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
  }
}

int CountEvents(CoordinatorCore& core, const std::string& kind) {
  int n = 0;
  for (const auto& e : core.Events("", 0, 1000)) n += e.kind() == kind;
  return n;
}

TEST_F(KeyedRecoveryTest, HeldDecisionsOfAnEarlierEpochAreNoEvidence) {
  // The probe: decisions of epoch 0 were taken with a claimed epoch 5.
  v1::RegisterRequest r = Resume(0, true);
  r.mutable_resume()->set_group_epoch(5);
  *r.mutable_resume()->add_held() = HeldDecision(0, 0, 0, v1::DECISION_PER_LAYER, &earlier_);
  absl::Status s = Register(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("a resume holds decisions of that epoch only"));
  EXPECT_EQ(CountEvents(*core_, "resume_refused"), 1) << "refused, evented and counted";
}

TEST_F(KeyedRecoveryTest, ACredentialOfAnotherRunOfTheJobIdResumesNothing) {
  // The probe: a client that registered the job id once, in a throwaway run, kept its
  // credential and sealed decisions; the job runs again (run kRun) and the daemon restarts.
  const std::string old_run = "ffffffffffffffffffffffffffffffff";
  const ResumeAuthority thrown_away = earlier_.ForRun("job", old_run);
  v1::RegisterRequest attack = Resume(1, false);
  attack.mutable_resume()->mutable_previous()->set_run_id(old_run);
  attack.mutable_resume()->set_credential(thrown_away.Credential("job", 1, 900, 0));
  v1::MicrobatchDecision held = Decision(0, 0, 0, v1::DECISION_PER_LAYER);
  held.set_seal(thrown_away.Seal("job", held));
  *attack.mutable_resume()->add_held() = held;
  // Its credential and seals verify for its own run only: claiming the current run fails them.
  v1::RegisterRequest claiming_current = attack;
  claiming_current.mutable_resume()->mutable_previous()->set_run_id(kRun);
  absl::Status s = Register(claiming_current);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("no valid resume credential for run " + std::string(kRun)));
  // The honest rank 0 resumes run kRun; then the old run's resume is refused as another run.
  ASSERT_TRUE(Register(Resume(0, true)).ok());
  s = Register(attack);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("resumes run " + old_run + ", not the job's current run " + kRun));
  EXPECT_EQ(CountEvents(*core_, "resume_refused"), 2);
  // The honest rank 1 is not locked out, and the group recovers from the honest ranks only.
  ASSERT_TRUE(Register(Resume(1, true)).ok());
  EXPECT_NE(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_FAILED);
}

// The probe of the gap left after run binding: a process that was rank 1 earlier in the same
// run (its registration 5) resumes first after a restart. The rank's current process, which
// holds its newest registration (11), takes the slot back; the older one is refused after that.
TEST_F(KeyedRecoveryTest, ANewerRegistrationOfTheRankTakesItsSlotAndAnOlderOneResumesNothing) {
  ASSERT_TRUE(Register(Resume(1, true, /*serial=*/5)).ok()) << "nothing tells it from the real rank yet";
  std::shared_ptr<testing::RecordingSink> stale = sinks_[1];
  const uint64_t stale_session = sessions_[1];
  ASSERT_TRUE(Register(Resume(1, true, /*serial=*/11)).ok()) << "the newest registration is never locked out";
  EXPECT_TRUE(stale->closed);
  EXPECT_EQ(stale->close_status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(stale->close_status.message(), HasSubstr("superseded: a process proved a newer registration of rank 1"));
  EXPECT_EQ(CountEvents(*core_, "rank_superseded"), 1);
  // The stale process comes back: refused, evented, and the slot stays the real rank's.
  absl::Status s = Register(Resume(1, true, /*serial=*/5));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("an older registration of a rank resumes nothing"));
  EXPECT_EQ(CountEvents(*core_, "resume_refused"), 1);
  // The stale session's end changes nothing for the rank's live one.
  core_->OnSessionClosed(stale_session, "stream lost");
  ASSERT_TRUE(Register(Resume(0, true)).ok());
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_HEALTHY);
  EXPECT_EQ(core_->Ranks("job").ranks(1).state(), v1::RANK_STATE_LIVE);
  EXPECT_FALSE(sinks_[1]->closed);
}

TEST_F(KeyedRecoveryTest, WhenTheRealRankComesFirstTheOlderRegistrationIsRefusedAtOnce) {
  ASSERT_TRUE(Register(Resume(1, true, /*serial=*/11)).ok());
  absl::Status s = Register(Resume(1, true, /*serial=*/5));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("since held by registration 11 of incarnation 900"));
  EXPECT_FALSE(sinks_[1]->closed);
  EXPECT_EQ(CountEvents(*core_, "rank_superseded"), 0);
  // Dead or alive: once the rank's newest process has been seen, an older one never resumes it.
  core_->OnSessionClosed(sessions_[1], "stream lost");
  EXPECT_EQ(Register(Resume(1, true, /*serial=*/5)).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Register(Resume(1, true, /*serial=*/11)).ok()) << "the same process retrying its resume is taken";
}

TEST_F(KeyedRecoveryTest, AFreshRankInARecoveringGroupGivesWayToTheRanksVerifiedResume) {
  // A holder of the job's token registers rank 1 afresh while the group waits for its members
  // after the restart: it proves no registration, so the rank's own resume takes the slot.
  ASSERT_TRUE(Register(Resume(0, true)).ok());
  ASSERT_TRUE(Register(Request(1)).ok());
  std::shared_ptr<testing::RecordingSink> squatter = sinks_[1];
  ASSERT_TRUE(Register(Resume(1, true)).ok());
  EXPECT_TRUE(squatter->closed);
  EXPECT_EQ(CountEvents(*core_, "rank_superseded"), 1);
  EXPECT_EQ(core_->Groups("job").groups(0).state(), v1::GROUP_STATE_HEALTHY);
}

TEST_F(KeyedRecoveryTest, ARankRegisteredAfreshByThisProcessIsNotTakenByAnyResume) {
  // Outside recovery, a fresh registration answered by this process is newer than anything an
  // earlier process answered: a resume of rank 1 is the duplicate it would be without one.
  ASSERT_TRUE(Register(Request(0)).ok());
  ASSERT_TRUE(Register(Request(1)).ok());
  const uint64_t serial = sinks_[1]->Where([](const auto& m) { return m.has_registered(); })[0].registered().registration();
  EXPECT_GT(serial, sinks_[0]->Where([](const auto& m) { return m.has_registered(); })[0].registered().registration())
      << "every answer a new serial";
  v1::RegisterRequest resume = Resume(1, false);
  const std::string run = sinks_[1]->Where([](const auto& m) { return m.has_registered(); })[0].registered().run_id();
  Prove(resume, earlier_, run, 1u << 30);
  absl::Status s = Register(resume);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("an older registration"));
  EXPECT_FALSE(sinks_[1]->closed);
}

// With a state file, the daemon pins the current run of every live job (run_pins.h): after a
// restart, a resume of any other run is refused even when it comes first.
class PinnedRecoveryTest : public KeyedRecoveryTest {
 protected:
  static CoordinatorOptions WithStateFile(const std::string& state) {
    CoordinatorOptions o = KeyedOptions();
    o.state_file = state;
    return o;
  }
  // The run each registration answer of `rank` named, in order.
  std::string RunOf(int rank) {
    auto registered = sinks_[rank]->Where([](const auto& m) { return m.has_registered(); });
    return registered.empty() ? "" : registered.back().registered().run_id();
  }
  testing::TempDir dir_;
  const std::string state_ = dir_.path() + "/state";
};

TEST_F(PinnedRecoveryTest, AfterARestartOnlyThePinnedRunResumesEvenIfAnEarlierRunComesFirst) {
  CoordinatorOptions before = WithStateFile(state_);
  before.incarnation = 900;
  Reset(before);
  // A throwaway run of "job": its client keeps the credential.
  ASSERT_TRUE(Register(Request(0)).ok());
  ASSERT_TRUE(Register(Request(1)).ok());
  const std::string thrown_away = RunOf(1);
  ASSERT_TRUE(ResumeAuthority::IsRunId(thrown_away));
  const v1::RegisterResponse kept = sinks_[1]->Where([](const auto& m) { return m.has_registered(); })[0].registered();
  core_->OnGoodbye(sessions_[0], "done");
  core_->OnGoodbye(sessions_[1], "done");
  core_->Tick();
  // The real run, under the same id: a new run id.
  ASSERT_TRUE(Register(Request(0)).ok());
  ASSERT_TRUE(Register(Request(1)).ok());
  const std::string real = RunOf(0);
  EXPECT_NE(real, thrown_away) << "a rerun is a new run";
  EXPECT_EQ(RunOf(1), real);
  auto pins = ReadRunPins(RunPinsPath(state_));
  ASSERT_TRUE(pins.ok()) << pins.status();
  EXPECT_EQ((*pins)["job"], real) << "pinned before the ranks were answered";

  // kill -9 and restart with the same state file: the attacker resumes first.
  Reset(WithStateFile(state_));
  v1::RegisterRequest attack = Resume(1, false);
  attack.mutable_resume()->mutable_previous()->set_run_id(thrown_away);
  attack.mutable_resume()->mutable_previous()->set_registration(kept.registration());
  attack.mutable_resume()->set_credential(kept.resume_credential());
  absl::Status s = Register(attack);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("not the job's current run " + real));
  EXPECT_THAT(s.message(), HasSubstr("pinned at the last stop"));
  EXPECT_EQ(CountEvents(*core_, "resume_refused"), 1);
  EXPECT_TRUE(core_->Status("").jobs().empty()) << "the refused resume created nothing";
  // The honest ranks resume the real run.
  for (int rank = 0; rank < 2; ++rank) {
    v1::RegisterRequest honest = Resume(rank, false);
    honest.mutable_resume()->mutable_previous()->set_run_id(real);
    Prove(honest, earlier_, real, 7);
    ASSERT_TRUE(Register(honest).ok()) << "rank " << rank;
  }
  EXPECT_EQ(RunOf(0), real);
}

TEST_F(PinnedRecoveryTest, AJobWithNoLiveRunAtTheStopCannotBeResumedAndADamagedFileResumesNothing) {
  Reset(WithStateFile(state_));
  absl::Status s = Register(Resume(0, true));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("the job had no live run when the last coordinator"));
  EXPECT_THAT(s.message(), HasSubstr("restart the job"));
  // A damaged runs file is no pin either (and says so in the log at start).
  std::ofstream(RunPinsPath(state_)) << "shardcoordd-runs 1\n" << kRun << " 6a6f62\ncheck 1\n";
  EXPECT_EQ(ReadRunPins(RunPinsPath(state_)).status().code(), absl::StatusCode::kDataLoss);
  Reset(WithStateFile(state_));
  EXPECT_EQ(Register(Resume(0, true)).code(), absl::StatusCode::kPermissionDenied);
  // Written by the daemon, it pins.
  ASSERT_TRUE(WriteRunPins(RunPinsPath(state_), {{"job", kRun}}).ok());
  struct stat st {};
  ASSERT_EQ(::stat(RunPinsPath(state_).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  Reset(WithStateFile(state_));
  EXPECT_TRUE(Register(Resume(0, true)).ok());
}

TEST_F(PinnedRecoveryTest, AResumeIntoAnEndedJobOfItsRunContinuesThatRunAndNoOther) {
  // Review: a job whose resumed ranks all went again before the others came back had ended;
  // every later resume was refused ("no live run"), and a rerun took a new run id, locking the
  // rest of the run out.
  ASSERT_TRUE(WriteRunPins(RunPinsPath(state_), {{"job", kRun}}).ok());
  Reset(WithStateFile(state_));
  ASSERT_TRUE(Register(Resume(0, true)).ok());
  core_->OnSessionClosed(sessions_[0], "stream lost");
  ASSERT_EQ(core_->Ranks("job").ranks(0).state(), v1::RANK_STATE_DEAD);
  // Another run's credential does not resume it...
  const std::string other = "ffffffffffffffffffffffffffffffff";
  v1::RegisterRequest attack = Resume(1, false);
  attack.mutable_resume()->mutable_previous()->set_run_id(other);
  attack.mutable_resume()->set_credential(earlier_.ForRun("job", other).Credential("job", 1, 900, 0));
  absl::Status s = Register(attack);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("not the job's current run " + std::string(kRun)));
  // ...the run's own does, and the run goes on.
  ASSERT_TRUE(Register(Resume(1, true)).ok());
  EXPECT_EQ(RunOf(1), kRun);
}

// The MAC is HMAC-SHA256 as RFC 2104 and OpenSSL's HMAC() make it (its pads are hashed once
// per key, not per call): a daemon upgraded across that change still verifies what the one
// before it sealed. Keys of 16, 32 and (hashed first) 100 bytes.
TEST(ResumeAuthorityTest, TheCredentialIsStandardHmacSha256) {
  for (size_t key_bytes : {16, 32, 100}) {
    std::string key(key_bytes, '\0');
    for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<char>(i * 7 + 1);
    const ResumeAuthority auth(key, true);
    std::string message = "shardcoord resume credential 2;";
    for (const std::string& f : {std::string("job"), std::string("3"), std::string("900"), std::string("12")}) {
      absl::StrAppend(&message, f.size(), ":", f, ";");
    }
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
         message.size(), mac, &len);
    EXPECT_EQ(auth.Credential("job", 3, 900, 12), absl::BytesToHexString(std::string(reinterpret_cast<char*>(mac), 16)))
        << key_bytes << "-byte key";
  }
}

// The resume key file is checked as the TLS key is (issue 44, item 6): what another user, a link
// or a crash could have left there is refused, naming it, and the file is made atomically.
class ResumeKeyFileTest : public ::testing::Test {
 protected:
  std::string Key() const { return dir_.path() + "/state.key"; }
  void Write(const std::string& content, mode_t mode) {
    std::ofstream(Key()) << content;
    ASSERT_EQ(::chmod(Key().c_str(), mode), 0);
  }
  testing::TempDir dir_;
  const std::string state_ = dir_.path() + "/state";
};

TEST_F(ResumeKeyFileTest, IsMadeOnceOwnerOnlyAndReadBack) {
  auto made = LoadResumeKey(state_, "");
  ASSERT_TRUE(made.ok()) << made.status();
  struct stat st;
  ASSERT_EQ(::stat(Key().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto again = LoadResumeKey(state_, "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->key, made->key);
}

TEST_F(ResumeKeyFileTest, RefusesWhatOthersMayReadALinkAndAZeroKey) {
  Write(std::string(64, 'a'), 0644);
  EXPECT_THAT(LoadResumeKey(state_, "").status().message(), HasSubstr("has mode 0644: others may read or change it"));
  Write(std::string(64, '0'), 0600);
  EXPECT_THAT(LoadResumeKey(state_, "").status().message(), HasSubstr("all-zero key"));
  ASSERT_EQ(::unlink(Key().c_str()), 0);
  const std::string planted = dir_.path() + "/planted";
  std::ofstream(planted) << std::string(64, 'b');
  ASSERT_EQ(::chmod(planted.c_str(), 0600), 0);
  ASSERT_EQ(::symlink(planted.c_str(), Key().c_str()), 0);
  EXPECT_THAT(LoadResumeKey(state_, "").status().message(), HasSubstr("is a symbolic link"));
}

TEST_F(ResumeKeyFileTest, AnEmptyFileLeftByACrashIsRemadeNotACrashLoop) {
  Write("", 0600);
  auto key = LoadResumeKey(state_, "");
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_EQ(key->key.size(), 32u);
  Write("not hex\n", 0600);
  EXPECT_THAT(LoadResumeKey(state_, "").status().message(), HasSubstr("does not hold 64 hex digits"));
}

TEST_F(ResumeKeyFileTest, AnotherUsersOrAnUnreadableFileIsNamedSoNotFileExists) {
  Write(std::string(64, 'c'), 0600);
  if (::geteuid() == 0) {  // Root may give it away (CI runs as root); root reads a mode 000 file.
    ASSERT_EQ(::chown(Key().c_str(), 12345, 12345), 0);
    EXPECT_THAT(LoadResumeKey(state_, "").status().message(), HasSubstr("belongs to uid 12345, neither the daemon's user"));
    return;
  }
  ASSERT_EQ(::chmod(Key().c_str(), 0), 0);
  EXPECT_THAT(LoadResumeKey(state_, "").status().message(), HasSubstr("cannot be read"));
}

}  // namespace
}  // namespace shardcoord::coordinator
