// The transport's edge for what workers send: a wire RegisterRequest becomes the core's
// Registration (coordinator/core/registration.h), a WorkerBundle its WorkerReport
// (coordinator/core/worker_report.h) and a communicator RPC its call
// (coordinator/core/comm_call.h), once per message, before the core is called; a
// communicator call's answer goes back the same way (ToWire). It copies
// every field the daemon reads (not Heartbeat.sent_unix_ms, the worker's clock) and judges
// none (Register validates a Registration; each part checks what it keeps of a report), but
// for what only the wire can get wrong: a plan without a MicrobatchKey (which no worker of
// this wire revision sends) arrives as a ReceivedPlan whose `malformed` says so, for its group
// to reject.
#ifndef SHARDCOORD_COORDINATOR_SERVER_WIRE_INTAKE_H_
#define SHARDCOORD_COORDINATOR_SERVER_WIRE_INTAKE_H_

#include "coordinator/core/comm_call.h"
#include "coordinator/core/registration.h"
#include "coordinator/core/worker_report.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

Registration FromWire(const v1::RegisterRequest& request);
WorkerReport FromWire(const v1::WorkerBundle& bundle);
HeartbeatReport FromWire(const v1::Heartbeat& heartbeat);
PlanBatchReport FromWire(const v1::PlanBatch& batch);
ReceivedPlan FromWire(const v1::MicrobatchPlan& plan);
CommAbortAck FromWire(const v1::CommAborted& ack);

CommJoinCall FromWire(const v1::CommJoinRequest& request);
StoreSetCall FromWire(const v1::StoreSetRequest& request);
StoreGetCall FromWire(const v1::StoreGetRequest& request);
CommReportCall FromWire(const v1::CommReportRequest& request);
v1::CommJoinResponse ToWire(const CommMembership& membership);
v1::StoreGetResponse ToWire(const std::vector<std::string>& values);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SERVER_WIRE_INTAKE_H_
