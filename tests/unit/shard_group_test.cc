// Unit tests of ShardGroup on its own: no core, no clock, no sinks. Each test sets members
// live as the core does (CoordinatorCore::SetLive), calls the group's operations with an
// explicit `now`, and asserts on the group's state and on the GroupEffects it returns
// (messages per member index or kEveryMember, decisions, events, warnings, counters).
#include "coordinator/core/shard_group.h"
#include "shardcoord/proto/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/core/group_effects.h"
#include "coordinator/core/invariant.h"
#include "coordinator/core/registration.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/journal/event_kind.h"
#include "coordinator/server/wire_intake.h"
#include "coordinator/settings/options.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;

constexpr char kJob[] = "job-a";
// Every group under test is group 1 with ranks 2, 3 (, 4): member indexes, ranks and the
// group index all differ, so a test catches one used for another.
constexpr int kGroupIndex = 1;
constexpr int kFirstRank = 2;
const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

CoordinatorOptions GroupOptions() {
  CoordinatorOptions o;
  o.plan_timeout = absl::Seconds(10);
  o.recovery_window = absl::Seconds(5);
  o.max_lookahead = 8;
  return o;
}

v1::MicrobatchPlan Plan(int64_t step, int mb, int vision, int audio = 0) {
  v1::MicrobatchPlan p;
  p.mutable_key()->set_step(step);
  p.mutable_key()->set_microbatch(mb);
  (*p.mutable_calls())["vision_tower"] = vision;
  (*p.mutable_calls())["audio_tower"] = audio;
  return p;
}

v1::PlanBatch Batch(int64_t epoch, std::vector<v1::MicrobatchPlan> plans) {
  v1::PlanBatch b;
  b.set_epoch(epoch);
  for (auto& p : plans) *b.add_plans() = std::move(p);
  return b;
}

// The messages of `fx` that carry a decision.
std::vector<GroupEffects::Message> DecisionMessages(const GroupEffects& fx) {
  std::vector<GroupEffects::Message> out;
  for (const auto& m : fx.messages) {
    if (m.decision) out.push_back(m);
  }
  return out;
}

std::vector<std::string> EventNames(const GroupEffects& fx) {
  std::vector<std::string> out;
  for (const auto& e : fx.events) out.push_back(EventKindName(e.kind));
  return out;
}

std::vector<int> Ranks(const google::protobuf::RepeatedField<int32_t>& r) { return {r.begin(), r.end()}; }

std::vector<std::string> Keys(const google::protobuf::RepeatedPtrField<v1::MicrobatchKey>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(MicrobatchKey{k.step(), k.microbatch()}.ToString());
  return out;
}

void ExpectModule(const v1::MicrobatchDecision& d, int index, const std::string& name, v1::Decision decision,
                  v1::DecisionReason reason) {
  ASSERT_LT(index, d.modules_size());
  EXPECT_EQ(d.modules(index).module(), name);
  EXPECT_EQ(d.modules(index).decision(), decision) << v1::Decision_Name(d.modules(index).decision());
  EXPECT_EQ(d.modules(index).reason(), reason) << v1::DecisionReason_Name(d.modules(index).reason());
}

class ShardGroupTest : public ::testing::Test {
 protected:
  // A group of `size` members whose first registration has `policy` and fallback root, a
  // manifest of two modules (vision_tower, audio_tower) and lookahead 4.
  void Make(int size, v1::Policy policy, v1::Fallback fallback = v1::FALLBACK_ROOT) {
    group_ = std::make_unique<ShardGroup>(kGroupIndex, kFirstRank, size, GroupRules{kJob, &options_, &auth_});
    v1::RegisterRequest r;
    r.set_job_id(kJob);
    r.set_rank(kFirstRank);
    r.set_world_size(16);
    r.set_group_size(size);
    r.set_policy(policy);
    r.set_fallback(fallback);
    r.set_wrap_outer_model(true);
    r.set_lookahead(4);
    for (const char* name : {"vision_tower", "audio_tower"}) {
      auto* m = r.add_modules();
      m->set_name(name);
      m->set_param_bytes(1000);
    }
    request_ = WithRegisterDefaults(FromWire(r), options_);
    group_->SetReference(request_, options_.promotion);
  }

  // What CoordinatorCore::Register and SetLive do to a member that registers.
  void SetLive(int idx, absl::Time now = kT0) {
    group_->ForgetMeasures(idx);
    group_->MemberLive(group_->ranks()[idx], request_, now);
    SessionBinding& b = group_->binding_at(idx);
    b.session = static_cast<uint64_t>(idx) + 100;
    b.cut_reason.clear();
  }

  // Every member live, and the group formed (HEALTHY).
  void Form() {
    for (int i = 0; i < group_->size(); ++i) SetLive(i);
    GroupEffects fx;
    group_->UpdateState(fx);
    ASSERT_EQ(group_->state(), v1::GROUP_STATE_HEALTHY);
  }

  GroupEffects TakePlans(int idx, std::vector<v1::MicrobatchPlan> plans, absl::Time now = kT0) {
    GroupEffects fx;
    group_->TakePlans(idx, FromWire(Batch(group_->epoch(), std::move(plans))), now, fx);
    return fx;
  }

  CoordinatorOptions options_ = GroupOptions();
  ResumeAuthority auth_ = ResumeAuthority::Ephemeral();
  Registration request_;
  std::unique_ptr<ShardGroup> group_;
};

// ---------------------------------------------------------------------------------------
// Forming

TEST_F(ShardGroupTest, AGroupFormsOnceEveryMemberIsLiveAndRecordsItWithoutMessages) {
  Make(2, v1::POLICY_PER_LAYER);
  SetLive(0);
  GroupEffects partial;
  group_->UpdateState(partial);
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_FORMING) << "rank 3 has not registered";
  EXPECT_TRUE(partial.empty());
  EXPECT_FALSE(group_->formed());

  SetLive(1);
  GroupEffects fx;
  group_->UpdateState(fx);
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_HEALTHY);
  EXPECT_TRUE(group_->formed());
  EXPECT_EQ(group_->epoch(), 0);
  EXPECT_THAT(EventNames(fx), ElementsAre("group_formed"));
  EXPECT_EQ(fx.events[0].rank, -1) << "the group's event, not one rank's";
  EXPECT_THAT(fx.events[0].message, HasSubstr("ranks 2,3"));
  EXPECT_THAT(fx.events[0].message, HasSubstr("policy=per_layer"));
  EXPECT_THAT(fx.messages, IsEmpty());
  EXPECT_EQ(fx.decided, 0);

  GroupEffects again;
  group_->UpdateState(again);
  EXPECT_TRUE(again.empty()) << "a formed group forms once";
}

// ---------------------------------------------------------------------------------------
// Per-layer and auto decisions

TEST_F(ShardGroupTest, AUniformMicrobatchIsDecidedPerLayerForEveryMemberOnceBothReportedIt) {
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  GroupEffects first = TakePlans(0, {Plan(0, 0, /*vision=*/2)}, kT0);
  EXPECT_EQ(first.plans_accepted, 1);
  EXPECT_THAT(DecisionMessages(first), IsEmpty()) << "rank 3 has not reported (0,0) yet";
  EXPECT_EQ(first.decided, 0);
  EXPECT_THAT(first.decision_latencies, IsEmpty());
  EXPECT_EQ(group_->PendingOf(0), 1);
  EXPECT_EQ(group_->members()[0].plans_received, 1);

  const absl::Time second_at = kT0 + absl::Milliseconds(250);
  GroupEffects second = TakePlans(1, {Plan(0, 0, /*vision=*/2)}, second_at);
  EXPECT_EQ(second.plans_accepted, 1);
  ASSERT_THAT(second.messages, SizeIs(1));
  const GroupEffects::Message& msg = second.messages[0];
  EXPECT_EQ(msg.member, GroupEffects::kEveryMember);
  ASSERT_TRUE(msg.decision.has_value());
  const v1::MicrobatchDecision& d = *msg.decision;
  EXPECT_EQ(d.group(), kGroupIndex);
  EXPECT_EQ(d.key().step(), 0);
  EXPECT_EQ(d.key().microbatch(), 0);
  EXPECT_EQ(d.seq(), 0u);
  EXPECT_EQ(d.epoch(), 0);
  ASSERT_EQ(d.modules_size(), 2);
  ExpectModule(d, 0, "vision_tower", v1::DECISION_PER_LAYER, v1::REASON_UNIFORM);
  ExpectModule(d, 1, "audio_tower", v1::DECISION_SKIP, v1::REASON_ALL_SKIP);
  EXPECT_FALSE(d.seal().empty());
  EXPECT_TRUE(auth_.CheckSeal(kJob, d)) << "sealed under the group's job";
  EXPECT_FALSE(auth_.CheckSeal("another-job", d));
  EXPECT_EQ(d.decided_unix_ms(), absl::ToUnixMillis(second_at));

  EXPECT_EQ(second.decided, 1);
  EXPECT_THAT(second.decision_latencies, ElementsAre(absl::Milliseconds(250)));
  EXPECT_THAT(group_->pending(), IsEmpty());
  ASSERT_TRUE(group_->last_decided().has_value());
  EXPECT_EQ(*group_->last_decided(), (MicrobatchKey{0, 0}));
  EXPECT_EQ(group_->module_counts().at("vision_tower").ToProto().per_layer(), 1);
  EXPECT_EQ(group_->module_counts().at("audio_tower").ToProto().skip(), 1);
  EXPECT_THAT(group_->history(), SizeIs(1));
  // Counts by kind: every kind of decisions.def by name, zero included, beside the frozen fields.
  v1::GroupStatus gs;
  group_->Describe(&gs);
  ASSERT_EQ(gs.counts().by_kind_size(), static_cast<int>(kNumDecisions));
  for (Decision kind : kDecisions) {
    EXPECT_EQ(gs.counts().by_kind().at(DecisionName(kind)), kind == Decision::kPerLayer || kind == Decision::kSkip)
        << DecisionName(kind);
  }
  EXPECT_EQ(gs.counts().per_layer(), 1);
  EXPECT_EQ(CountOf(gs.counts(), Decision::kSkip), 1);
  // What an older daemon answers (the frozen fields only) is read the same way.
  v1::DecisionCounts older;
  older.set_padded(7);
  EXPECT_EQ(CountOf(older, Decision::kPadded), 7);
  EXPECT_EQ(CountOf(older, Decision::kRoot), 0);
}

TEST_F(ShardGroupTest, ADivergentMicrobatchFallsBackToRootForEveryMember) {
  Make(2, v1::POLICY_AUTO);
  Form();
  GroupEffects first = TakePlans(0, {Plan(3, 1, /*vision=*/1, /*audio=*/1)}, kT0);
  EXPECT_THAT(DecisionMessages(first), IsEmpty());
  const absl::Time second_at = kT0 + absl::Seconds(2);
  GroupEffects second = TakePlans(1, {Plan(3, 1, /*vision=*/0, /*audio=*/1)}, second_at);
  ASSERT_THAT(second.messages, SizeIs(1));
  EXPECT_EQ(second.messages[0].member, GroupEffects::kEveryMember);
  ASSERT_TRUE(second.messages[0].decision.has_value());
  const v1::MicrobatchDecision& d = *second.messages[0].decision;
  EXPECT_EQ(d.key().step(), 3);
  EXPECT_EQ(d.key().microbatch(), 1);
  ExpectModule(d, 0, "vision_tower", v1::DECISION_ROOT, v1::REASON_DIVERGENT);
  ExpectModule(d, 1, "audio_tower", v1::DECISION_PER_LAYER, v1::REASON_UNIFORM);
  EXPECT_TRUE(auth_.CheckSeal(kJob, d));
  EXPECT_EQ(second.decided, 1);
  EXPECT_THAT(second.decision_latencies, ElementsAre(absl::Seconds(2)));
  EXPECT_EQ(group_->module_counts().at("vision_tower").ToProto().root(), 1);
  EXPECT_EQ(group_->module_counts().at("vision_tower").ToProto().divergent(), 1);
}

TEST_F(ShardGroupTest, DecisionsComeInKeyOrderWithConsecutiveSeqs) {
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  EXPECT_THAT(DecisionMessages(TakePlans(0, {Plan(0, 0, 1), Plan(0, 1, 0)}, kT0)), IsEmpty());
  GroupEffects fx = TakePlans(1, {Plan(0, 0, 1), Plan(0, 1, 0)}, kT0 + absl::Seconds(1));
  EXPECT_EQ(fx.plans_accepted, 2);
  const auto decisions = DecisionMessages(fx);
  ASSERT_THAT(decisions, SizeIs(2));
  EXPECT_EQ(decisions[0].decision->key().microbatch(), 0);
  EXPECT_EQ(decisions[0].decision->seq(), 0u);
  EXPECT_EQ(decisions[1].decision->key().microbatch(), 1);
  EXPECT_EQ(decisions[1].decision->seq(), 1u);
  ExpectModule(*decisions[1].decision, 0, "vision_tower", v1::DECISION_SKIP, v1::REASON_ALL_SKIP);
  EXPECT_EQ(fx.decided, 2);
  EXPECT_THAT(fx.decision_latencies, ElementsAre(absl::Seconds(1), absl::Seconds(1)));
}

// ---------------------------------------------------------------------------------------
// Rejected plans

TEST_F(ShardGroupTest, APlanWithoutAKeyIsRejectedNamingWhatIsMissing) {
  // A worker of the wire before MicrobatchKey sends step and microbatch in fields this one
  // reserves: its plan arrives with no key, and must not be taken for microbatch (0,0).
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  v1::MicrobatchPlan old = Plan(0, 0, 1);
  old.clear_key();
  GroupEffects fx = TakePlans(0, {old});
  EXPECT_EQ(fx.plans_accepted, 0);
  ASSERT_THAT(fx.messages, SizeIs(1));
  ASSERT_TRUE(fx.messages[0].message.has_plan_rejected());
  const v1::PlanRejected& rej = fx.messages[0].message.plan_rejected();
  EXPECT_EQ(rej.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(rej.message(), HasSubstr("carries no key"));
  EXPECT_THAT(rej.message(), HasSubstr("every plan must name its microbatch"));
  EXPECT_FALSE(group_->members()[0].last_planned.has_value()) << "nothing of it was taken";
}

TEST_F(ShardGroupTest, AnOutOfOrderPlanIsRejectedToItsSenderOnly) {
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  ASSERT_EQ(TakePlans(0, {Plan(0, 1, 1)}).plans_accepted, 1);
  GroupEffects fx = TakePlans(0, {Plan(0, 0, 1)});
  EXPECT_EQ(fx.plans_accepted, 0);
  ASSERT_THAT(fx.messages, SizeIs(1));
  EXPECT_EQ(fx.messages[0].member, 0) << "rank 2's index only, not every member";
  EXPECT_FALSE(fx.messages[0].decision.has_value());
  ASSERT_TRUE(fx.messages[0].message.has_plan_rejected());
  const v1::PlanRejected& rej = fx.messages[0].message.plan_rejected();
  EXPECT_EQ(rej.key().step(), 0);
  EXPECT_EQ(rej.key().microbatch(), 0);
  EXPECT_EQ(rej.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(rej.epoch(), 0);
  EXPECT_THAT(rej.message(), HasSubstr("out-of-order plan (0,0)"));
  EXPECT_THAT(rej.message(), HasSubstr("previous plan was (0,1)"));
  EXPECT_EQ(group_->members()[0].plans_rejected, 1);
  EXPECT_EQ(group_->members()[1].plans_rejected, 0);
  ASSERT_THAT(fx.warnings, SizeIs(1));
  EXPECT_THAT(fx.warnings[0], HasSubstr("job=job-a"));
  EXPECT_THAT(fx.warnings[0], HasSubstr("rank=2"));
  EXPECT_THAT(fx.warnings[0], HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(group_->pending(), SizeIs(1)) << "the rejected plan adds nothing";
}

TEST_F(ShardGroupTest, APlanNamingAModuleOutsideTheManifestIsRejectedAsInvalid) {
  Make(2, v1::POLICY_AUTO);
  Form();
  v1::MicrobatchPlan bad = Plan(0, 0, 1);
  (*bad.mutable_calls())["text_tower"] = 1;
  GroupEffects fx = TakePlans(1, {bad});
  EXPECT_EQ(fx.plans_accepted, 0);
  ASSERT_THAT(fx.messages, SizeIs(1));
  EXPECT_EQ(fx.messages[0].member, 1);
  ASSERT_TRUE(fx.messages[0].message.has_plan_rejected());
  EXPECT_EQ(fx.messages[0].message.plan_rejected().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(fx.messages[0].message.plan_rejected().message(), HasSubstr("unknown module 'text_tower'"));
  EXPECT_EQ(group_->members()[1].plans_rejected, 1);
  EXPECT_EQ(group_->members()[1].plans_received, 0);
  EXPECT_EQ(group_->members()[0].plans_rejected, 0);
  ASSERT_THAT(fx.warnings, SizeIs(1));
  EXPECT_THAT(fx.warnings[0], HasSubstr("job=job-a"));
  EXPECT_THAT(fx.warnings[0], HasSubstr("rank=3"));
  EXPECT_THAT(group_->pending(), IsEmpty());
  EXPECT_FALSE(group_->members()[1].last_planned.has_value()) << "a rejected plan does not move the rank's order";
}

// ---------------------------------------------------------------------------------------
// Static policies

TEST_F(ShardGroupTest, UnderPolicyRootEachMemberGetsTheSameDecisionAsSoonAsItReports) {
  Make(2, v1::POLICY_ROOT);
  Form();
  GroupEffects first = TakePlans(0, {Plan(0, 0, /*vision=*/1)}, kT0);
  EXPECT_EQ(first.plans_accepted, 1);
  ASSERT_THAT(first.messages, SizeIs(1));
  EXPECT_EQ(first.messages[0].member, 0) << "to the member that reported, not the group";
  ASSERT_TRUE(first.messages[0].decision.has_value());
  const v1::MicrobatchDecision d0 = *first.messages[0].decision;
  ExpectModule(d0, 0, "vision_tower", v1::DECISION_ROOT, v1::REASON_STATIC_POLICY);
  ExpectModule(d0, 1, "audio_tower", v1::DECISION_ROOT, v1::REASON_STATIC_POLICY);
  EXPECT_EQ(d0.seq(), 0u);
  EXPECT_TRUE(auth_.CheckSeal(kJob, d0));
  EXPECT_EQ(first.decided, 1);
  EXPECT_THAT(group_->pending(), SizeIs(1)) << "pending until rank 3 reported it too";
  EXPECT_FALSE(group_->last_resolved().has_value());

  // Rank 3's calls differ: a static policy ignores them.
  GroupEffects second = TakePlans(1, {Plan(0, 0, /*vision=*/0)}, kT0 + absl::Seconds(3));
  ASSERT_THAT(second.messages, SizeIs(1));
  EXPECT_EQ(second.messages[0].member, 1);
  ASSERT_TRUE(second.messages[0].decision.has_value());
  const v1::MicrobatchDecision& d1 = *second.messages[0].decision;
  EXPECT_EQ(d1.seq(), d0.seq());
  EXPECT_EQ(d1.seal(), d0.seal());
  EXPECT_EQ(d1.SerializeAsString(), d0.SerializeAsString()) << "the very decision rank 2 got";
  EXPECT_EQ(second.decided, 0) << "one decision, given twice, is counted once";
  EXPECT_THAT(group_->pending(), IsEmpty());
  ASSERT_TRUE(group_->last_resolved().has_value());
  EXPECT_EQ(*group_->last_resolved(), (MicrobatchKey{0, 0}));
  EXPECT_EQ(group_->module_counts().at("vision_tower").ToProto().root(), 1);
}

// ---------------------------------------------------------------------------------------
// Plan timeout

TEST_F(ShardGroupTest, AMicrobatchOneMemberNeverReportsFailsAfterThePlanTimeoutNamingThatRank) {
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  ASSERT_EQ(TakePlans(0, {Plan(1, 2, 1)}, kT0).plans_accepted, 1);

  GroupEffects early;
  group_->ExpirePlans(kT0 + options_.plan_timeout, early);
  EXPECT_TRUE(early.empty()) << "not past the timeout yet";
  EXPECT_THAT(group_->pending(), SizeIs(1));

  GroupEffects fx;
  group_->ExpirePlans(kT0 + options_.plan_timeout + absl::Milliseconds(1), fx);
  ASSERT_THAT(fx.messages, SizeIs(1));
  EXPECT_EQ(fx.messages[0].member, GroupEffects::kEveryMember);
  ASSERT_TRUE(fx.messages[0].message.has_microbatch_failed());
  const v1::MicrobatchFailed& f = fx.messages[0].message.microbatch_failed();
  EXPECT_EQ(f.group(), kGroupIndex);
  EXPECT_EQ(f.key().step(), 1);
  EXPECT_EQ(f.key().microbatch(), 2);
  EXPECT_EQ(f.code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(f.message(), HasSubstr("from ranks 3 (ranks 2 reported it)"));
  EXPECT_THAT(EventNames(fx), ElementsAre("microbatch_failed"));
  EXPECT_EQ(fx.events[0].severity, Severity::kError);
  EXPECT_EQ(fx.decided, 0);
  EXPECT_THAT(group_->pending(), IsEmpty());
  EXPECT_EQ(group_->PendingOf(0), 0) << "rank 2's window is free again";

  // The late plan of the failed microbatch is stale.
  GroupEffects late = TakePlans(1, {Plan(1, 2, 1)}, kT0 + absl::Seconds(11));
  ASSERT_THAT(late.messages, SizeIs(1));
  ASSERT_TRUE(late.messages[0].message.has_plan_rejected());
  EXPECT_THAT(late.messages[0].message.plan_rejected().message(), HasSubstr("is stale"));
}

// ---------------------------------------------------------------------------------------
// Deaths and re-forming

// A batch over what a worker ever sends (two windows and 16) is a broken protocol: the group
// takes none of it and asks the core to cut the member (GroupEffects::cuts; the core keeps the
// reason in the member's session binding, never seen by the group, and fails the rank at the tick).
TEST_F(ShardGroupTest, ABatchOverTheWindowAsksTheCoreToCutTheMember) {
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  std::vector<v1::MicrobatchPlan> plans;
  for (int mb = 0; mb <= MaxPlansPerBatch(request_.lookahead); ++mb) plans.push_back(Plan(0, mb, 1));
  const GroupEffects fx = TakePlans(1, plans);
  ASSERT_THAT(fx.cuts, SizeIs(1));
  EXPECT_EQ(fx.cuts[0].first, 1);
  EXPECT_THAT(fx.cuts[0].second, HasSubstr("broke the protocol: sent " + std::to_string(plans.size()) + " plans"));
  EXPECT_EQ(fx.plans_accepted, 0);
  EXPECT_THAT(fx.messages, IsEmpty()) << "no rejection per plan: those alone could fill its outbox";
  EXPECT_THAT(group_->pending(), IsEmpty());
  EXPECT_THAT(TakePlans(0, {Plan(0, 0, 1)}).cuts, IsEmpty());
}

TEST_F(ShardGroupTest, AMemberDeathFailsTheGroupAndCancelsEveryPendingMicrobatch) {
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  ASSERT_EQ(TakePlans(0, {Plan(0, 0, 1), Plan(0, 1, 1)}).plans_accepted, 2);

  // As CoordinatorCore::RemoveMember does before FailGroup.
  group_->MemberGone(group_->ranks()[1], /*clean=*/false, "no heartbeat");
  GroupEffects fx;
  const std::string reason = group_->Fail(1, "no heartbeat for 5000 ms", fx);
  EXPECT_EQ(reason, "group 1 of job 'job-a' failed at epoch 0: no heartbeat for 5000 ms");
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_FAILED);
  EXPECT_THAT(group_->pending(), IsEmpty());
  EXPECT_EQ(group_->failure_reason(), "no heartbeat for 5000 ms");

  ASSERT_THAT(fx.messages, SizeIs(1));
  EXPECT_EQ(fx.messages[0].member, GroupEffects::kEveryMember);
  ASSERT_TRUE(fx.messages[0].message.has_group_failure());
  const v1::GroupFailure& gf = fx.messages[0].message.group_failure();
  EXPECT_EQ(gf.group(), kGroupIndex);
  EXPECT_EQ(gf.epoch(), 0);
  EXPECT_THAT(Ranks(gf.dead_ranks()), ElementsAre(3));
  EXPECT_THAT(Keys(gf.cancelled()), ElementsAre("(0,0)", "(0,1)"));
  EXPECT_EQ(gf.reason(), reason);
  EXPECT_THAT(EventNames(fx), ElementsAre("group_failed"));
  EXPECT_EQ(fx.events[0].rank, 3);
  EXPECT_THAT(fx.events[0].message, HasSubstr("cancelled 2 pending microbatches"));

  // The survivor's next plan is refused while the group is failed.
  GroupEffects refused = TakePlans(0, {Plan(0, 2, 1)});
  ASSERT_THAT(refused.messages, SizeIs(1));
  ASSERT_TRUE(refused.messages[0].message.has_plan_rejected());
  EXPECT_EQ(refused.messages[0].message.plan_rejected().code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_THAT(group_->pending(), IsEmpty());
}

TEST_F(ShardGroupTest, AFailedGroupReFormsInTheNextEpochOnceTheDeadMemberIsLiveAgain) {
  Make(2, v1::POLICY_PER_LAYER);
  Form();
  TakePlans(0, {Plan(0, 0, 1)});
  ASSERT_THAT(DecisionMessages(TakePlans(1, {Plan(0, 0, 1)})), SizeIs(1));  // seq 0, epoch 0
  group_->MemberGone(group_->ranks()[0], /*clean=*/false, "stream lost");
  GroupEffects failed;
  group_->Fail(0, "stream lost", failed);
  ASSERT_EQ(group_->state(), v1::GROUP_STATE_FAILED);

  SetLive(0, kT0 + absl::Seconds(1));
  GroupEffects fx;
  group_->UpdateState(fx);
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_HEALTHY);
  EXPECT_EQ(group_->epoch(), 1);
  EXPECT_TRUE(group_->failure_reason().empty());
  EXPECT_THAT(EventNames(fx), ElementsAre("group_reformed"));
  EXPECT_THAT(fx.events[0].message, HasSubstr("epoch 1"));
  EXPECT_THAT(fx.messages, IsEmpty()) << "the core announces the re-form (AnnounceReformed)";

  // A plan queued in the failed epoch is refused with that epoch.
  GroupEffects stale;
  group_->TakePlans(1, FromWire(Batch(0, {Plan(0, 1, 1)})), kT0 + absl::Seconds(2), stale);
  ASSERT_THAT(stale.messages, SizeIs(1));
  ASSERT_TRUE(stale.messages[0].message.has_plan_rejected());
  EXPECT_EQ(stale.messages[0].message.plan_rejected().code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_EQ(stale.messages[0].message.plan_rejected().epoch(), 0);

  // Keys start afresh in the new epoch; the seq goes on.
  TakePlans(0, {Plan(0, 0, 1)}, kT0 + absl::Seconds(3));
  const auto decisions = DecisionMessages(TakePlans(1, {Plan(0, 0, 1)}, kT0 + absl::Seconds(3)));
  ASSERT_THAT(decisions, SizeIs(1));
  EXPECT_EQ(decisions[0].decision->epoch(), 1);
  EXPECT_EQ(decisions[0].decision->seq(), 1u);
  EXPECT_TRUE(auth_.CheckSeal(kJob, *decisions[0].decision));
}

// ---------------------------------------------------------------------------------------
// Leaving

TEST_F(ShardGroupTest, ALeaverFailsWhatItNeverPlannedAndWhatItPlannedIsStillDecided) {
  Make(3, v1::POLICY_PER_LAYER);  // Ranks 2, 3, 4.
  Form();
  ASSERT_EQ(TakePlans(0, {Plan(0, 0, 1), Plan(0, 1, 1)}).plans_accepted, 2);
  ASSERT_EQ(TakePlans(1, {Plan(0, 0, /*vision=*/0)}).plans_accepted, 1);

  group_->MemberGone(group_->ranks()[1], /*clean=*/true, "left");  // As CoordinatorCore::RemoveMember does.
  GroupEffects fx;
  group_->OnLeft(1, kT0 + absl::Seconds(1), fx);
  ASSERT_THAT(fx.messages, SizeIs(1));
  EXPECT_EQ(fx.messages[0].member, GroupEffects::kEveryMember);
  ASSERT_TRUE(fx.messages[0].message.has_microbatch_failed());
  EXPECT_EQ(fx.messages[0].message.microbatch_failed().key().microbatch(), 1);
  EXPECT_THAT(fx.messages[0].message.microbatch_failed().message(),
              HasSubstr("rank 3 left the job without planning it"));
  EXPECT_THAT(EventNames(fx), ElementsAre("microbatch_failed"));
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_HEALTHY);
  ASSERT_THAT(group_->pending(), SizeIs(1));
  EXPECT_EQ(group_->pending().begin()->first, (MicrobatchKey{0, 0}));

  // Rank 4 reports (0,0): decided with the leaver's calls (0 against 1: divergent).
  const absl::Time last_at = kT0 + absl::Seconds(2);
  GroupEffects decided = TakePlans(2, {Plan(0, 0, 1)}, last_at);
  const auto decisions = DecisionMessages(decided);
  ASSERT_THAT(decisions, SizeIs(1));
  EXPECT_EQ(decisions[0].member, GroupEffects::kEveryMember);
  EXPECT_EQ(decisions[0].decision->key().microbatch(), 0);
  ExpectModule(*decisions[0].decision, 0, "vision_tower", v1::DECISION_ROOT, v1::REASON_DIVERGENT);
  EXPECT_EQ(decided.decided, 1);
  EXPECT_THAT(decided.decision_latencies, ElementsAre(absl::Seconds(2)));
  EXPECT_THAT(group_->pending(), IsEmpty());

  // A later key the leaver cannot report fails at once.
  GroupEffects later = TakePlans(0, {Plan(0, 2, 1)}, last_at);
  EXPECT_THAT(DecisionMessages(later), IsEmpty());
  ASSERT_THAT(later.messages, SizeIs(1));
  ASSERT_TRUE(later.messages[0].message.has_microbatch_failed());
  EXPECT_THAT(later.messages[0].message.microbatch_failed().message(), HasSubstr("ranks 3 already planned"));
  EXPECT_THAT(group_->pending(), IsEmpty());
}

TEST_F(ShardGroupTest, AKeyTheLeaverSkippedFailsAtOnceAndWhatWaitedBehindItIsDecided) {
  // Rank 3 reports (0,1) only, then leaves; rank 2 then reports (0,0), which rank 3 skipped.
  // (0,0) can never be decided: it fails at once, instead of holding (0,1) back until the plan
  // timeout failed both.
  Make(3, v1::POLICY_PER_LAYER);
  Form();
  ASSERT_EQ(TakePlans(1, {Plan(0, 1, 1)}).plans_accepted, 1);
  group_->MemberGone(group_->ranks()[1], /*clean=*/true, "left");
  GroupEffects left;
  group_->OnLeft(1, kT0, left);
  EXPECT_THAT(left.messages, IsEmpty()) << "it reported the one pending key";

  GroupEffects fx = TakePlans(0, {Plan(0, 0, 1), Plan(0, 1, 1)});
  EXPECT_THAT(DecisionMessages(fx), IsEmpty());
  ASSERT_THAT(fx.messages, SizeIs(1));
  ASSERT_TRUE(fx.messages[0].message.has_microbatch_failed());
  EXPECT_EQ(fx.messages[0].message.microbatch_failed().key().microbatch(), 0);
  EXPECT_THAT(fx.messages[0].message.microbatch_failed().message(), HasSubstr("ranks 3 already planned"));
  GroupEffects last = TakePlans(2, {Plan(0, 1, 1)}, kT0 + absl::Seconds(1));
  const auto decisions = DecisionMessages(last);
  ASSERT_THAT(decisions, SizeIs(1)) << "(0,1) is complete and no longer behind (0,0)";
  EXPECT_EQ(decisions[0].decision->key().microbatch(), 1);
  EXPECT_THAT(group_->pending(), IsEmpty());
}

TEST_F(ShardGroupTest, UnderPolicyRootAKeyThatFailsOnArrivalIsNeverDecided) {
  // Rank 3 planned past (0,0): under root, rank 2's report of (0,0) fails the key, and rank 2
  // must not first be given a decision for it (nor may it take a seq or count as decided).
  Make(2, v1::POLICY_ROOT);
  Form();
  GroupEffects ahead = TakePlans(1, {Plan(0, 1, 1)});
  ASSERT_THAT(DecisionMessages(ahead), SizeIs(1));
  GroupEffects fx = TakePlans(0, {Plan(0, 0, 1)});
  EXPECT_THAT(DecisionMessages(fx), IsEmpty());
  ASSERT_THAT(fx.messages, SizeIs(1));
  EXPECT_TRUE(fx.messages[0].message.has_microbatch_failed());
  EXPECT_EQ(fx.decided, 0);
  ASSERT_TRUE(group_->last_decided().has_value());
  EXPECT_EQ(*group_->last_decided(), (MicrobatchKey{0, 1})) << "the failed key is not in the history";
  GroupEffects next = TakePlans(0, {Plan(0, 1, 1)});
  const auto decisions = DecisionMessages(next);
  ASSERT_THAT(decisions, SizeIs(1));
  EXPECT_EQ(decisions[0].decision->seq(), DecisionMessages(ahead)[0].decision->seq());
}

// ---------------------------------------------------------------------------------------
// Recovery after a coordinator restart

TEST_F(ShardGroupTest, ARecoveringGroupDefersPlansAndFailsTheMembersNotBackByItsDeadline) {
  Make(2, v1::POLICY_PER_LAYER);
  // As CoordinatorCore::Register does for the first rank that resumes: the group starts to
  // recover, then the rank is live with what it holds (ResumeMember). Rank 3 never resumes.
  ASSERT_TRUE(group_->IsFresh());
  GroupEffects started;
  group_->StartRecovery(kT0, started);
  SetLive(0);
  group_->HoldResume(group_->ranks()[0], v1::ResumeState{}, BufferCharge());
  GroupEffects waiting;
  group_->MaybeFinishRecovery(kT0, waiting);
  EXPECT_TRUE(waiting.empty()) << "rank 3 has not resumed";
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_RECOVERING);
  EXPECT_EQ(group_->recovery_deadline(), kT0 + options_.recovery_window);
  EXPECT_THAT(EventNames(started), ElementsAre("group_recovering"));
  EXPECT_EQ(started.events[0].severity, Severity::kWarning);
  EXPECT_THAT(started.messages, IsEmpty());

  GroupEffects deferred = TakePlans(0, {Plan(0, 0, 1), Plan(0, 1, 1)}, kT0 + absl::Seconds(1));
  EXPECT_THAT(deferred.messages, IsEmpty());
  EXPECT_EQ(deferred.plans_accepted, 0) << "held, not yet taken";
  EXPECT_THAT(group_->deferred_plans(), SizeIs(2));
  EXPECT_THAT(group_->pending(), IsEmpty());

  GroupEffects still;
  std::string why, each;
  EXPECT_THAT(group_->ExpireRecovery(kT0 + options_.recovery_window - absl::Milliseconds(1), &why, &each, still),
              IsEmpty());
  EXPECT_TRUE(still.empty());
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_RECOVERING);
  EXPECT_THAT(group_->deferred_plans(), SizeIs(2));

  GroupEffects fx;
  EXPECT_THAT(group_->ExpireRecovery(kT0 + options_.recovery_window, &why, &each, fx), ElementsAre(3));
  EXPECT_EQ(group_->members()[1].state, v1::RANK_STATE_DEAD);
  EXPECT_EQ(group_->members()[1].dead_reason, each);
  EXPECT_THAT(each, HasSubstr("did not resume within the recovery window (5000 ms"));
  EXPECT_EQ(group_->members()[0].state, v1::RANK_STATE_LIVE);
  EXPECT_THAT(why, HasSubstr("1 of 2 ranks (3) did not resume"));
  EXPECT_THAT(EventNames(fx), ElementsAre("recovery_expired"));
  EXPECT_EQ(fx.events[0].message, why);
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_FAILED);
  EXPECT_THAT(group_->deferred_plans(), IsEmpty());
  EXPECT_EQ(group_->recovery_deadline(), absl::InfiniteFuture());
}

// ---------------------------------------------------------------------------------------
// Heartbeats: memory and costs

TEST_F(ShardGroupTest, ARecoveryWindowEndingWithEveryMemberLiveReFormsTheGroupAndSaysWhy) {
  // Not reachable through the core (a rank joining a recovering group always resumes): a
  // broken invariant, said as one, and the group re-forms with a notice instead of staying
  // FAILED without an event.
  Make(2, v1::POLICY_PER_LAYER);
  GroupEffects started;
  group_->StartRecovery(kT0, started);
  SetLive(0);
  SetLive(1);
  group_->HoldResume(group_->ranks()[0], v1::ResumeState{}, BufferCharge());
  const int64_t broken_before = InvariantFailures();
  GroupEffects fx;
  std::string why, each;
  EXPECT_THAT(group_->ExpireRecovery(kT0 + options_.recovery_window, &why, &each, fx), IsEmpty());
  EXPECT_EQ(InvariantFailures(), broken_before + 1);
  EXPECT_EQ(group_->state(), v1::GROUP_STATE_HEALTHY);
  EXPECT_EQ(group_->epoch(), 1);
  EXPECT_FALSE(group_->members()[0].resume.has_value());
  EXPECT_EQ(group_->recovery_deadline(), absl::InfiniteFuture());
  EXPECT_THAT(EventNames(fx), ElementsAre("group_recovery_failed", "group_reformed"));
  ASSERT_THAT(fx.messages, SizeIs(2));
  EXPECT_TRUE(fx.messages[0].message.has_group_failure());
  EXPECT_THAT(fx.messages[0].message.group_failure().reason(), HasSubstr("not every one resumed"));
  EXPECT_EQ(fx.messages[1].message.notice().kind(), v1::Notice::KIND_GROUP_REFORMED);
}

TEST_F(ShardGroupTest, AHeartbeatKeepsMemoryOnlyForManifestModulesWithSaneNumbers) {
  Make(2, v1::POLICY_AUTO);
  Form();
  v1::Heartbeat hb;
  auto add = [&](const std::string& module, int64_t resident, int64_t peak, int64_t gathered) {
    auto* e = hb.add_memory();
    e->set_module(module);
    e->set_resident_bytes(resident);
    e->set_peak_bytes(peak);
    e->set_gathered_bytes(gathered);
  };
  add("text_tower", 1, 1, 1);              // Not in the manifest.
  add("audio_tower", -5, 10, 10);          // Negative.
  add("vision_tower", 100, 200, 300);
  add("vision_tower", 999, 999, 999);      // The module's second entry.
  add("audio_tower", 10, 20, -1);          // Negative.
  hb.set_decision_stalls(7);
  GroupEffects fx;
  group_->TakeHeartbeat(1, FromWire(hb), kT0 + absl::Seconds(1), fx);
  const Member& m = group_->members()[1];
  ASSERT_THAT(m.memory, SizeIs(1));
  EXPECT_EQ(m.memory[0].module, "vision_tower");
  EXPECT_EQ(m.memory[0].resident_bytes, 100);
  EXPECT_EQ(m.memory[0].peak_bytes, 200);
  ASSERT_THAT(m.gathered_bytes, SizeIs(1));
  EXPECT_EQ(m.gathered_bytes.at("vision_tower").total(), 300);
  EXPECT_EQ(m.decision_stalls.total(), 7);
  EXPECT_EQ(m.last_seen, kT0 + absl::Seconds(1));
  EXPECT_TRUE(group_->members()[0].memory.empty());
  EXPECT_TRUE(fx.empty()) << "no cost report: nothing for the journal";
}

TEST_F(ShardGroupTest, ACostReportThatMovesTheGroupsModelIsRecordedAsAnEvent) {
  Make(2, v1::POLICY_AUTO);
  Form();
  auto report = [](double forward, double gather) {
    v1::Heartbeat hb;
    auto* c = hb.add_costs();
    c->set_module("vision_tower");
    c->set_forward_seconds_per_call(forward);
    auto* u = c->add_units();
    u->set_gather_bytes(1000);
    u->set_gather_seconds(gather);
    auto* unknown = hb.add_costs();
    unknown->set_module("text_tower");
    unknown->set_forward_seconds_per_call(9);
    return FromWire(hb);
  };
  GroupEffects fx;
  group_->TakeHeartbeat(0, report(0.02, 0.01), kT0, fx);
  ASSERT_THAT(EventNames(fx), ElementsAre("group_cost_model"));
  EXPECT_EQ(fx.events[0].rank, 2);
  EXPECT_THAT(fx.events[0].message, HasSubstr("module 'vision_tower': forward 0.0200 s/call, gather 0.0100 s"));
  EXPECT_THAT(fx.events[0].message, Not(HasSubstr("text_tower")));
  ASSERT_THAT(group_->cost_model(), SizeIs(2));
  EXPECT_DOUBLE_EQ(group_->cost_model()[0].forward_seconds_per_call, 0.02);
  EXPECT_DOUBLE_EQ(group_->cost_model()[1].forward_seconds_per_call, 0) << "audio_tower: not reported";

  // Closer than kMinCostReportSpacing to the last one: dropped, whatever it says.
  GroupEffects soon;
  group_->TakeHeartbeat(0, report(0.5, 0.5), kT0 + kMinCostReportSpacing - absl::Milliseconds(1), soon);
  EXPECT_THAT(soon.events, IsEmpty());
  EXPECT_DOUBLE_EQ(group_->cost_model()[0].forward_seconds_per_call, 0.02);

  // Within a tenth of the model: kept by the member, the engine's model stays.
  GroupEffects close;
  group_->TakeHeartbeat(0, report(0.021, 0.0105), kT0 + absl::Seconds(5), close);
  EXPECT_THAT(close.events, IsEmpty());
  EXPECT_DOUBLE_EQ(group_->cost_model()[0].forward_seconds_per_call, 0.02);

  // Another member's larger measure moves the maximum by more than a tenth.
  GroupEffects other;
  group_->TakeHeartbeat(1, report(0.04, 0.01), kT0 + absl::Seconds(5), other);
  ASSERT_THAT(EventNames(other), ElementsAre("group_cost_model"));
  EXPECT_EQ(other.events[0].rank, 3);
  EXPECT_DOUBLE_EQ(group_->cost_model()[0].forward_seconds_per_call, 0.04);
}

// The exclusive paths' take of a group's mutex (CoordinatorCore::HeldGroup) nests: an inner
// take only counts, and the mutex is free again only after the outermost release.
bool InnerScopeTakesAndReleases(GroupMutex& mu) {  // As a removal inside a scan of its group.
  const bool without_waiting = mu.LockNested();
  mu.UnlockNested();
  return without_waiting;
}

TEST(GroupMutexTest, NestedTakesCountAndOnlyTheOutermostReleaseFreesTheMutex) {
  GroupMutex mu;
  const auto free_for_another_thread = [&mu] {
    bool took = false;
    std::thread([&] {
      if (mu.TryLock()) {
        took = true;
        mu.Unlock();
      }
    }).join();
    return took;
  };
  const bool without_waiting = mu.LockNested();  // Free: taken without waiting.
  EXPECT_TRUE(without_waiting);
  EXPECT_TRUE(InnerScopeTakesAndReleases(mu));
  EXPECT_FALSE(free_for_another_thread()) << "an inner release freed the mutex its outer scope holds";
  mu.UnlockNested();
  EXPECT_TRUE(free_for_another_thread()) << "the outermost release left the mutex held";
  EXPECT_TRUE(InnerScopeTakesAndReleases(mu));  // The depth came back to 0: a take locks again.
  EXPECT_TRUE(free_for_another_thread());
}

}  // namespace

}  // namespace shardcoord::coordinator
