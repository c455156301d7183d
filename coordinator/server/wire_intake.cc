#include "coordinator/server/wire_intake.h"

#include <string>
#include <vector>

#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {

HeartbeatReport FromWire(const v1::Heartbeat& hb) {
  HeartbeatReport out;
  out.comms.reserve(hb.comms_size());
  for (const auto& p : hb.comms()) out.comms.push_back({p.name(), p.epoch(), p.issued(), p.completed()});
  out.memory.reserve(hb.memory_size());
  for (const auto& m : hb.memory()) out.memory.push_back(FromProto(m));
  out.decision_stalls = hb.decision_stalls();
  out.decision_stall_us = hb.decision_stall_us();
  out.costs.reserve(hb.costs_size());
  for (const auto& c : hb.costs()) out.costs.push_back(FromProto(c));
  out.frozen_budget_bytes = hb.frozen_budget_bytes();
  return out;
}

ReceivedPlan FromWire(const v1::MicrobatchPlan& plan) {
  ReceivedPlan out;
  if (!plan.has_key()) {
    out.malformed =
        "it carries no key (MicrobatchPlan.key), which every worker of this wire revision sends: the client is "
        "broken or not a shardcoord worker; every plan must name its microbatch by a MicrobatchKey";
    return out;
  }
  out.plan = FromProto(plan);
  return out;
}

PlanBatchReport FromWire(const v1::PlanBatch& batch) {
  PlanBatchReport out;
  out.epoch = batch.epoch();
  out.plans.reserve(batch.plans_size());
  for (const auto& p : batch.plans()) out.plans.push_back(FromWire(p));
  return out;
}

CommAbortAck FromWire(const v1::CommAborted& ack) { return {ack.name(), ack.epoch()}; }

Registration FromWire(const v1::RegisterRequest& req) {
  Registration out;
  out.job_id = req.job_id();
  out.rank = req.rank();
  out.world_size = req.world_size();
  out.group_size = req.group_size();
  out.modules.reserve(req.modules_size());
  for (const auto& m : req.modules()) out.modules.push_back(FromProto(m));
  out.policy = FromProto(req.policy());
  out.fallback = FromProto(req.fallback());
  out.wrap_outer_model = req.wrap_outer_model();
  out.lookahead = req.lookahead();
  out.memory_budget_bytes = req.memory_budget_bytes();
  out.host = req.host();
  out.pid = req.pid();
  out.wire_revision = req.wire_revision();
  if (req.has_resume()) out.resume = req.resume();
  return out;
}

WorkerReport FromWire(const v1::WorkerBundle& bundle) {
  WorkerReport out;
  if (bundle.has_heartbeat()) out.heartbeat = FromWire(bundle.heartbeat());
  out.comm_aborted.reserve(bundle.comm_aborted_size());
  for (const auto& ack : bundle.comm_aborted()) out.comm_aborted.push_back(FromWire(ack));
  if (bundle.has_plans()) out.plans = FromWire(bundle.plans());
  return out;
}

// ---------------------------------------------------------------------------------------
// The communicator calls

namespace {

template <typename Request>
CommCallerId CallerOf(const Request& r) {
  return {r.job_id(), r.rank(), r.session_key()};
}

}  // namespace

CommJoinCall FromWire(const v1::CommJoinRequest& r) {
  return {CallerOf(r), r.name(), std::vector<int>(r.ranks().begin(), r.ranks().end()),
          absl::Milliseconds(r.timeout_ms())};
}

StoreSetCall FromWire(const v1::StoreSetRequest& r) { return {CallerOf(r), r.name(), r.epoch(), r.key(), r.value()}; }

StoreGetCall FromWire(const v1::StoreGetRequest& r) {
  return {CallerOf(r), r.name(), r.epoch(), std::vector<std::string>(r.keys().begin(), r.keys().end()),
          absl::Milliseconds(r.timeout_ms())};
}

static_assert(static_cast<int>(CommReportKind::kUnspecified) == v1::CommReportRequest::KIND_UNSPECIFIED &&
                  static_cast<int>(CommReportKind::kReady) == v1::CommReportRequest::KIND_READY &&
                  static_cast<int>(CommReportKind::kError) == v1::CommReportRequest::KIND_ERROR,
              "CommReportKind keeps the wire's values");

// The kind keeps the value sent, a kind of no name included: CommTable::Report names it.
CommReportCall FromWire(const v1::CommReportRequest& r) {
  return {CallerOf(r), r.name(), r.epoch(), static_cast<CommReportKind>(r.kind()), r.error()};
}

v1::CommJoinResponse ToWire(const CommMembership& m) {
  v1::CommJoinResponse out;
  out.set_epoch(m.epoch);
  for (int r : m.ranks) out.add_ranks(r);
  out.set_previous_abort_reason(m.previous_abort_reason);
  return out;
}

v1::StoreGetResponse ToWire(const std::vector<std::string>& values) {
  v1::StoreGetResponse out;
  for (const std::string& v : values) out.add_values(v);
  return out;
}

}  // namespace shardcoord::coordinator
