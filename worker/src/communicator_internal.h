// Internal to the worker library: the pieces Worker and the collective backends share.
#ifndef SHARDCOORD_WORKER_SRC_COMMUNICATOR_INTERNAL_H_
#define SHARDCOORD_WORKER_SRC_COMMUNICATOR_INTERNAL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardcoord/communicator.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace shardcoord::internal {

// Where a communicator's rendezvous and reports go.
struct CommEndpoint {
  std::shared_ptr<v1::Coordinator::Stub> stub;  // Shared: a communicator may outlive its Worker.
  std::string coordinator;                // For messages.
  std::string job_id;
  int job_rank = 0;
};

// A communicator the worker can abort when the coordinator says so.
class AbortableCommunicator : public Communicator {
 public:
  using Communicator::Communicator;
  // The coordinator aborted this epoch. Called from the worker's reader thread; must not
  // block on the network. Pending and later collectives fail with ABORTED and `reason`.
  virtual void Abort(const std::string& reason) = 0;
  // Joins the rendezvous and connects to every member, within the join timeout.
  virtual absl::Status Connect() = 0;
  // Collectives started and finished in this epoch; sent with heartbeats so the
  // coordinator can name a member that keeps the others waiting. Thread-safe.
  virtual void Progress(int64_t* issued, int64_t* completed) const = 0;
};

// Gloo over TCP. The device binds to $SHARDCOORD_GLOO_HOST, else this host's name.
std::shared_ptr<AbortableCommunicator> MakeGlooCommunicator(const CommEndpoint& endpoint,
                                                            const std::string& name, int64_t epoch,
                                                            std::vector<int> ranks,
                                                            const CommunicatorOptions& options);

// NCCL, when built with SHARDCOORD_WITH_NCCL (nccl_communicator.cc).
std::shared_ptr<AbortableCommunicator> MakeNcclCommunicator(const CommEndpoint& endpoint,
                                                            const std::string& name, int64_t epoch,
                                                            std::vector<int> ranks,
                                                            const CommunicatorOptions& options);

// The epoch's key-value store at the coordinator (comm_rendezvous.cc). Publishing a key
// twice is ALREADY_EXISTS; fetching waits up to `timeout` for every key.
absl::Status StorePublish(const CommEndpoint& endpoint, const std::string& name, int64_t epoch,
                          const std::string& key, const std::string& value);
absl::StatusOr<std::vector<std::string>> StoreFetch(const CommEndpoint& endpoint, const std::string& name,
                                                    int64_t epoch, const std::vector<std::string>& keys,
                                                    absl::Duration timeout);

// Reports to the coordinator with a deadline; returns the RPC's status.
absl::Status ReportComm(const CommEndpoint& endpoint, const std::string& name, int64_t epoch,
                        v1::CommReportRequest::Kind kind, const std::string& error);

}  // namespace shardcoord::internal

#endif  // SHARDCOORD_WORKER_SRC_COMMUNICATOR_INTERNAL_H_
