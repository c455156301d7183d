// Internal to the worker library: the worker's open communicators, by name (the latest
// epoch of each). The coordinator's aborts are delivered through it and heartbeats read the
// collective progress from it (DESIGN 4). It holds weak references: a communicator lives as
// long as the trainer holds it, and is forgotten after.
//
// Thread-safe. Its mutex is a leaf: nothing is called while it is held, so it may be used
// under the worker's own mutex.
#ifndef SHARDCOORD_WORKER_SRC_COMM_REGISTRY_H_
#define SHARDCOORD_WORKER_SRC_COMM_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "comm_base.h"

namespace shardcoord::internal {

class CommRegistry {
 public:
  // `comm` is now the open epoch of its name (replacing an older one).
  void Add(std::shared_ptr<AbortableCommunicator> comm) ABSL_LOCKS_EXCLUDED(mu_);
  // The open communicator `name`, if it is still held and at `epoch`; else null.
  std::shared_ptr<AbortableCommunicator> Find(const std::string& name, int64_t epoch) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every communicator still held, by name.
  std::vector<std::shared_ptr<AbortableCommunicator>> Open() const ABSL_LOCKS_EXCLUDED(mu_);

  struct Progress {
    std::string name;
    int64_t epoch = 0;
    int64_t issued = 0;
    int64_t completed = 0;
  };
  // The collective progress of every open communicator, for a heartbeat.
  std::vector<Progress> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::weak_ptr<AbortableCommunicator>> comms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcoord::internal

#endif  // SHARDCOORD_WORKER_SRC_COMM_REGISTRY_H_
