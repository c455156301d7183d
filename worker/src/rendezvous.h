// Internal to the worker library: a communicator epoch's rendezvous, as the collective
// backends see it (DESIGN 4). The coordinator keeps one key-value store per (communicator,
// epoch) and takes each member's health reports; the backends reach it only through
// EpochRendezvous, so their connect and abort paths can be tested without gRPC
// (tests/unit/comm_backend_test.cc gives them an in-memory one).
#ifndef SHARDCOORD_WORKER_SRC_RENDEZVOUS_H_
#define SHARDCOORD_WORKER_SRC_RENDEZVOUS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardcoord::internal {

class EpochRendezvous {
 public:
  virtual ~EpochRendezvous() = default;
  // Publishes `key` in this epoch's store; a key is published once (ALREADY_EXISTS after).
  virtual absl::Status Publish(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` until every key is published; the values in the order of `keys`.
  // DEADLINE_EXCEEDED names the missing keys; ABORTED when the epoch was aborted meanwhile.
  virtual absl::StatusOr<std::vector<std::string>> Fetch(const std::vector<std::string>& keys,
                                                        absl::Duration timeout) = 0;
  // This member connected to every other one.
  virtual absl::Status ReportReady() = 0;
  // A collective failed here. The coordinator aborts the epoch for every member; when it
  // had aborted it already, the answer is ABORTED and its message names the cause.
  virtual absl::Status ReportError(const std::string& error) = 0;
};

}  // namespace shardcoord::internal

#endif  // SHARDCOORD_WORKER_SRC_RENDEZVOUS_H_
