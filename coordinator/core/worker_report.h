// WorkerReport: what a registered worker reports (the wire's WorkerMessage.bundle), in the
// core's types. The transport converts each WorkerBundle once, at the edge
// (coordinator/server/wire_intake.h); the core, its groups and the communicator table read
// only these. Nothing here is checked yet: each part checks what it keeps (names against the
// group's manifest, counts and measures in range, DESIGN 11), and the conversion drops
// nothing the daemon reads, so what a hostile client sends is judged by the same rules as
// before.
#ifndef SHARDCOORD_COORDINATOR_CORE_WORKER_REPORT_H_
#define SHARDCOORD_COORDINATOR_CORE_WORKER_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardcoord/cost.h"
#include "shardcoord/types.h"

namespace shardcoord::coordinator {

// How far the rank got in one communicator's collectives (this epoch).
struct CommProgressReport {
  std::string name;
  int64_t epoch = 0;
  int64_t issued = 0;     // Collectives started.
  int64_t completed = 0;  // Collectives finished (successfully or not).
};

// The rank aborted its communicator `name` for `epoch` (it acknowledges a CommAbort).
struct CommAbortAck {
  std::string name;
  int64_t epoch = 0;
};

// A heartbeat: the rank is alive, with what it measured.
struct HeartbeatReport {
  std::vector<CommProgressReport> comms;   // One per open communicator.
  std::vector<ModuleMemoryUsage> memory;   // Latest frozen-parameter memory, when reported.
  int64_t decision_stalls = 0;             // Since the worker was created.
  int64_t decision_stall_us = 0;
  std::vector<ModuleCost> costs;           // Medians of recent microbatches, when measured.
  int64_t frozen_budget_bytes = 0;         // 0: not measured.
};

// One plan as it arrived. `malformed`: what the transport could not read in it (a plan
// without a key, which no worker of this wire revision sends); the group rejects such a plan
// with that text, and `plan` is then empty.
struct ReceivedPlan {
  MicrobatchPlan plan;
  std::string malformed;
};

// Plans made in one group epoch (plans of another epoch were queued before a failure).
struct PlanBatchReport {
  int64_t epoch = 0;
  std::vector<ReceivedPlan> plans;
};

// Everything a worker had queued since its last message, taken in this order: heartbeat,
// abort acknowledgements, plans.
struct WorkerReport {
  std::optional<HeartbeatReport> heartbeat;
  std::vector<CommAbortAck> comm_aborted;
  std::optional<PlanBatchReport> plans;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_WORKER_REPORT_H_
