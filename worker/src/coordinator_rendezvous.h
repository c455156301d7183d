// Internal to the worker library: EpochRendezvous (rendezvous.h) at the coordinator, over
// gRPC. Every call has a deadline.
#ifndef SHARDCOORD_WORKER_SRC_COORDINATOR_RENDEZVOUS_H_
#define SHARDCOORD_WORKER_SRC_COORDINATOR_RENDEZVOUS_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "rendezvous.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace shardcoord::internal {

// The worker's current session key (RegisterResponse.session_key), which its communicator
// calls must carry; replaced when the worker resumes with a restarted coordinator.
class SessionKey {
 public:
  std::string Get() const {
    absl::MutexLock lock(&mu_);
    return key_;
  }
  void Set(std::string key) {
    absl::MutexLock lock(&mu_);
    key_ = std::move(key);
  }

 private:
  mutable absl::Mutex mu_;
  std::string key_ ABSL_GUARDED_BY(mu_);
};

// Where a worker's rendezvous calls go.
struct CommEndpoint {
  std::shared_ptr<v1::Coordinator::Stub> stub;  // Shared: a communicator may outlive its Worker.
  std::string job_id;
  int job_rank = 0;
  std::shared_ptr<const SessionKey> session_key;
  std::string token;  // `authorization: Bearer` on each call when not empty.
};

// The coordinator's store and reports for communicator `name` at `epoch`.
std::shared_ptr<EpochRendezvous> MakeCoordinatorRendezvous(const CommEndpoint& endpoint, const std::string& name,
                                                           int64_t epoch);

}  // namespace shardcoord::internal

#endif  // SHARDCOORD_WORKER_SRC_COORDINATOR_RENDEZVOUS_H_
