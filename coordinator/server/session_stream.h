// SessionStreams: the rank Session streams on gRPC's completion-queue API, spread over
// several completion queues, each drained by a thread of its own (DESIGN 9).
//
// Why not the callback API, as for every other method: Debian's gRPC 1.51 is built without
// NDEBUG, and a completion queue then checks every completion against the list of all the
// operations outstanding on it (cq_check_tag: a linear scan, under the queue's mutex). The
// callback API puts the operations of every stream of the process on one queue, so each
// message cost O(open streams) under one lock: 35% of the daemon's CPU with 16,384 ranks,
// and all of it serial (docs/BENCHMARKS.md, issue 14). Here each queue holds 1/N of the
// streams, and the N queues run in parallel.
#ifndef SHARDCOORD_COORDINATOR_SERVER_SESSION_STREAM_H_
#define SHARDCOORD_COORDINATOR_SERVER_SESSION_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/coordinator_core.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace shardcoord::coordinator {

// The Coordinator service with Session on the completion-queue API, raw (its messages as bytes:
// decisions are written as encoded once per group, decision_wire.h), and every other method on
// the callback API.
using CoordinatorServiceBase = v1::Coordinator::WithRawMethod_Session<
    v1::Coordinator::WithCallbackMethod_GetStatus<v1::Coordinator::WithCallbackMethod_ListRanks<
        v1::Coordinator::WithCallbackMethod_ListGroups<v1::Coordinator::WithCallbackMethod_ListDecisions<
            v1::Coordinator::WithCallbackMethod_ListEvents<v1::Coordinator::WithCallbackMethod_CommJoin<
                v1::Coordinator::WithCallbackMethod_StoreSet<v1::Coordinator::WithCallbackMethod_StoreGet<
                    v1::Coordinator::WithCallbackMethod_CommReport<
                        v1::Coordinator::WithCallbackMethod_ListComms<v1::Coordinator::Service>>>>>>>>>>>;

class SessionStreams {
 public:
  // Whether a new stream may open: the only job it may register for ("" for any), or the
  // error to close it with.
  using Authorize = std::function<absl::StatusOr<std::string>(grpc::ServerContextBase* ctx)>;

  // Adds `threads` completion queues to `builder`; construct before builder.BuildAndStart().
  SessionStreams(CoordinatorCore* core, CoordinatorServiceBase* service, Authorize authorize, int threads,
                 grpc::ServerBuilder& builder);
  // Stops first if Start ran and Stop did not.
  ~SessionStreams();

  SessionStreams(const SessionStreams&) = delete;
  SessionStreams& operator=(const SessionStreams&) = delete;

  // Once the server runs: a thread per queue, then waits for streams on every queue.
  // RESOURCE_EXHAUSTED when a thread cannot be made (an address-space or thread limit): nothing
  // is awaited then, and Stop() drains what was started.
  absl::Status Start();
  // Once the server's Shutdown() returned: drains the queues, joins their threads.
  void Stop();

  // Internal (the calls' shared context).
  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SERVER_SESSION_STREAM_H_
