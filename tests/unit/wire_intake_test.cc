// The transport's edge (coordinator/server/wire_intake.h): what a worker sends becomes the
// core's types with every field carried over and nothing judged, but for a plan without a key;
// a communicator call's answer goes back to the wire whole.
#include "coordinator/server/wire_intake.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "coordinator/core/registration.h"
#include "coordinator/settings/options.h"

namespace shardcoord::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

TEST(WireIntakeTest, ABundleArrivesWhole) {
  v1::WorkerBundle b;
  v1::Heartbeat* hb = b.mutable_heartbeat();
  hb->set_decision_stalls(3);
  hb->set_decision_stall_us(4500);
  hb->set_frozen_budget_bytes(1 << 20);
  auto* p = hb->add_comms();
  p->set_name("world");
  p->set_epoch(2);
  p->set_issued(10);
  p->set_completed(9);
  auto* mem = hb->add_memory();
  mem->set_module("visual");
  mem->set_resident_bytes(100);
  mem->set_peak_bytes(200);
  mem->set_gathered_bytes(-1);  // Carried as sent: the group drops what is out of range.
  auto* cost = hb->add_costs();
  cost->set_module("visual");
  cost->set_forward_seconds_per_call(0.25);
  auto* unit = cost->add_units();
  unit->set_unit("blocks.0");
  unit->set_gather_bytes(4096);
  unit->set_gather_seconds(0.5);
  auto* ack = b.add_comm_aborted();
  ack->set_name("world");
  ack->set_epoch(1);
  v1::PlanBatch* batch = b.mutable_plans();
  batch->set_epoch(7);
  auto* plan = batch->add_plans();
  plan->mutable_key()->set_step(5);
  plan->mutable_key()->set_microbatch(1);
  (*plan->mutable_calls())["visual"] = 2;
  batch->add_plans();  // No key.

  const WorkerReport r = FromWire(b);
  ASSERT_TRUE(r.heartbeat.has_value());
  EXPECT_EQ(r.heartbeat->decision_stalls, 3);
  EXPECT_EQ(r.heartbeat->decision_stall_us, 4500);
  EXPECT_EQ(r.heartbeat->frozen_budget_bytes, 1 << 20);
  ASSERT_THAT(r.heartbeat->comms, SizeIs(1));
  EXPECT_EQ(r.heartbeat->comms[0].name, "world");
  EXPECT_EQ(r.heartbeat->comms[0].epoch, 2);
  EXPECT_EQ(r.heartbeat->comms[0].issued, 10);
  EXPECT_EQ(r.heartbeat->comms[0].completed, 9);
  ASSERT_THAT(r.heartbeat->memory, SizeIs(1));
  EXPECT_EQ(r.heartbeat->memory[0].module, "visual");
  EXPECT_EQ(r.heartbeat->memory[0].peak_bytes, 200);
  EXPECT_EQ(r.heartbeat->memory[0].gathered_bytes, -1);
  ASSERT_THAT(r.heartbeat->costs, SizeIs(1));
  EXPECT_EQ(r.heartbeat->costs[0].forward_seconds_per_call, 0.25);
  ASSERT_THAT(r.heartbeat->costs[0].units, SizeIs(1));
  EXPECT_EQ(r.heartbeat->costs[0].units[0].unit, "blocks.0");
  EXPECT_EQ(r.heartbeat->costs[0].units[0].gather_bytes, 4096);
  EXPECT_EQ(r.heartbeat->costs[0].units[0].gather_seconds, 0.5);
  ASSERT_THAT(r.comm_aborted, SizeIs(1));
  EXPECT_EQ(r.comm_aborted[0].name, "world");
  EXPECT_EQ(r.comm_aborted[0].epoch, 1);
  ASSERT_TRUE(r.plans.has_value());
  EXPECT_EQ(r.plans->epoch, 7);
  ASSERT_THAT(r.plans->plans, SizeIs(2));
  EXPECT_THAT(r.plans->plans[0].malformed, IsEmpty());
  EXPECT_EQ(r.plans->plans[0].plan.key, (MicrobatchKey{5, 1}));
  EXPECT_EQ(r.plans->plans[0].plan.calls.at("visual"), 2);
  EXPECT_THAT(r.plans->plans[1].malformed, HasSubstr("carries no key (MicrobatchPlan.key)"));
  EXPECT_THAT(r.plans->plans[1].malformed, HasSubstr("every plan must name its microbatch by a MicrobatchKey"));
}

TEST(WireIntakeTest, AnEmptyBundleHasNoParts) {
  const WorkerReport r = FromWire(v1::WorkerBundle());
  EXPECT_FALSE(r.heartbeat.has_value());
  EXPECT_THAT(r.comm_aborted, IsEmpty());
  EXPECT_FALSE(r.plans.has_value());
}

TEST(WireIntakeTest, ARegistrationArrivesWholeAndUnjudged) {
  v1::RegisterRequest req;
  req.set_job_id("job");
  req.set_rank(3);
  req.set_world_size(8);
  req.set_group_size(4);
  req.set_policy(static_cast<v1::Policy>(99));  // Not defined: kept for the check to name.
  req.set_fallback(v1::FALLBACK_PADDED);
  req.set_wrap_outer_model(true);
  req.set_lookahead(6);
  req.set_memory_budget_bytes(1 << 30);
  req.set_host("node-1");
  req.set_pid(4242);
  req.set_wire_revision(2);
  auto* m = req.add_modules();
  m->set_name("visual");
  m->set_param_bytes(300);
  m->set_outside_inner_root(true);
  auto* u = m->add_units();
  u->set_name("blocks.0");
  u->set_param_bytes(200);
  req.mutable_resume()->set_incarnation(11);
  req.mutable_resume()->set_credential("c");

  const Registration r = FromWire(req);
  EXPECT_EQ(r.job_id, "job");
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.group_size, 4);
  EXPECT_EQ(static_cast<int>(r.policy), 99);
  EXPECT_EQ(r.fallback, Fallback::kPadded);
  EXPECT_TRUE(r.wrap_outer_model);
  EXPECT_EQ(r.lookahead, 6);
  EXPECT_EQ(r.memory_budget_bytes, 1 << 30);
  EXPECT_EQ(r.host, "node-1");
  EXPECT_EQ(r.pid, 4242);
  EXPECT_EQ(r.wire_revision, 2u);
  ASSERT_THAT(r.modules, SizeIs(1));
  EXPECT_EQ(r.modules[0].name, "visual");
  EXPECT_EQ(r.modules[0].param_bytes, 300);
  EXPECT_TRUE(r.modules[0].outside_inner_root);
  ASSERT_THAT(r.modules[0].units, SizeIs(1));
  EXPECT_EQ(r.modules[0].units[0].name, "blocks.0");
  EXPECT_EQ(r.modules[0].units[0].param_bytes, 200);
  ASSERT_TRUE(r.resume.has_value());
  EXPECT_EQ(r.resume->incarnation(), 11u);
  EXPECT_EQ(r.resume->credential(), "c");
  EXPECT_FALSE(FromWire(v1::RegisterRequest()).resume.has_value()) << "no resume: a first registration";

  const absl::Status s = ValidateRegistration(r, CoordinatorLimits{}, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("unknown policy or fallback value"));
}

// The communicator RPCs: every field, the caller's identity included, and a kind of no name
// kept for CommTable::Report to refuse by its number; answers go back whole.
TEST(WireIntakeTest, CommunicatorCallsArriveWholeAndAnswersGoBack) {
  v1::CommJoinRequest join;
  join.set_job_id("job");
  join.set_rank(1);
  join.set_session_key("k1");
  join.set_name("custom");
  join.add_ranks(0);
  join.add_ranks(1);
  join.set_timeout_ms(2500);
  const CommJoinCall j = FromWire(join);
  EXPECT_EQ(j.caller.job_id, "job");
  EXPECT_EQ(j.caller.rank, 1);
  EXPECT_EQ(j.caller.session_key, "k1");
  EXPECT_EQ(j.name, "custom");
  EXPECT_THAT(j.ranks, ::testing::ElementsAre(0, 1));
  EXPECT_EQ(j.timeout, absl::Milliseconds(2500));

  v1::StoreSetRequest set;
  set.set_rank(2);
  set.set_name("world");
  set.set_epoch(3);
  set.set_key("nccl_id");
  set.set_value(std::string("\0\1", 2));
  const StoreSetCall st = FromWire(set);
  EXPECT_EQ(st.caller.rank, 2);
  EXPECT_EQ(st.epoch, 3);
  EXPECT_EQ(st.key, "nccl_id");
  EXPECT_EQ(st.value, std::string("\0\1", 2)) << "bytes, not text";

  v1::StoreGetRequest get;
  get.set_epoch(4);
  get.add_keys("a");
  get.add_keys("b");
  const StoreGetCall g = FromWire(get);
  EXPECT_EQ(g.epoch, 4);
  EXPECT_THAT(g.keys, ::testing::ElementsAre("a", "b"));
  EXPECT_EQ(g.timeout, absl::ZeroDuration()) << "unset: the table's default wait";

  v1::CommReportRequest report;
  report.set_kind(v1::CommReportRequest::KIND_ERROR);
  report.set_error("ncclAllReduce failed");
  report.set_epoch(5);
  const CommReportCall r = FromWire(report);
  EXPECT_EQ(r.kind, CommReportKind::kError);
  EXPECT_EQ(r.error, "ncclAllReduce failed");
  EXPECT_EQ(r.epoch, 5);
  report.set_kind(static_cast<v1::CommReportRequest::Kind>(3));
  EXPECT_EQ(static_cast<int>(FromWire(report).kind), 3);

  const v1::CommJoinResponse jr = ToWire(CommMembership{7, {0, 1}, "rank 1 died"});
  EXPECT_EQ(jr.epoch(), 7);
  EXPECT_THAT(jr.ranks(), ::testing::ElementsAre(0, 1));
  EXPECT_EQ(jr.previous_abort_reason(), "rank 1 died");
  EXPECT_THAT(ToWire(std::vector<std::string>{"x", "y"}).values(), ::testing::ElementsAre("x", "y"));
}

}  // namespace
}  // namespace shardcoord::coordinator
