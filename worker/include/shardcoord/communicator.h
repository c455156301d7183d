// Collectives over a communicator whose rendezvous and health the coordinator manages
// (DESIGN 4). Obtain one from Worker::OpenCommunicator.
//
// Collective rule: every member calls the same collectives, in the same order, with the
// same counts and types. Each call returns within its timeout (CommunicatorOptions::
// op_timeout): a lost peer or an abort makes pending and later calls fail with ABORTED,
// naming the rank and the cause, instead of hanging.
//
// Epochs: when any member dies or reports an error, the coordinator aborts the
// communicator's epoch for every member. A clean leave (Worker::Close) aborts nobody; the
// epoch is closed once every member left, and ended for the others (ABORTED on their calls)
// when a member that left registers again. Open the communicator again (same name) to join
// the next epoch; that waits until every member is live again.
//
// Thread-safety: collectives on one Communicator must be issued from one thread at a time
// (like NCCL and Gloo). Health(), epoch() and the accessors may be called from any thread;
// an abort may arrive from the worker's reader thread at any moment.
#ifndef SHARDCOORD_COMMUNICATOR_H_
#define SHARDCOORD_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "shardcoord/export.h"

namespace shardcoord {

enum class DataType { kFloat32, kFloat64, kInt32, kInt64, kUint8 };
enum class ReduceOp { kSum, kMax, kMin };

SHARDCOORD_EXPORT size_t DataTypeSize(DataType t);

inline constexpr absl::Duration kDefaultJoinTimeout = absl::Seconds(60);
inline constexpr absl::Duration kDefaultOpTimeout = absl::Seconds(30);

enum class Backend {
  kGloo,  // CPU tensors, TCP. Always built.
  kNccl,  // GPU tensors (device pointers). Built with the CMake option SHARDCOORD_WITH_NCCL.
};

// True when this build of the worker library has the NCCL backend.
SHARDCOORD_EXPORT bool HasNcclBackend();

struct CommunicatorOptions {
  // "world", "group" (this rank's shard group), "group/<g>", or a custom name with `ranks`.
  std::string name = "group";
  std::vector<int> ranks;  // Custom communicators only: ascending, including this rank.
  absl::Duration join_timeout = kDefaultJoinTimeout;  // Waiting for members and rendezvous.
  absl::Duration op_timeout = kDefaultOpTimeout;      // Each collective.
  Backend backend = Backend::kGloo;
  int cuda_device = 0;  // NCCL: the device this rank uses; buffers must live there.
};

class SHARDCOORD_EXPORT Communicator {
 public:
  virtual ~Communicator() = default;

  const std::string& name() const { return name_; }
  int64_t epoch() const { return epoch_; }
  int rank() const { return rank_; }  // Index of this process in ranks().
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }  // Job ranks, ascending.

  // OK while usable; ABORTED (with the reason) once the epoch was aborted.
  virtual absl::Status Health() const = 0;

  // out[i * count .. (i+1) * count) = in of member i.
  virtual absl::Status AllGather(const void* in, void* out, size_t count, DataType type) = 0;
  // In place.
  virtual absl::Status AllReduce(void* data, size_t count, DataType type, ReduceOp op) = 0;
  // In place; `root` is an index in ranks().
  virtual absl::Status Broadcast(void* data, size_t count, DataType type, int root) = 0;
  virtual absl::Status Barrier() = 0;

  // Typed conveniences.
  absl::Status AllGather(const float* in, float* out, size_t count) {
    return AllGather(in, out, count, DataType::kFloat32);
  }
  absl::Status AllReduce(float* data, size_t count, ReduceOp op = ReduceOp::kSum) {
    return AllReduce(data, count, DataType::kFloat32, op);
  }
  absl::Status AllReduce(int64_t* data, size_t count, ReduceOp op = ReduceOp::kSum) {
    return AllReduce(data, count, DataType::kInt64, op);
  }

 protected:
  Communicator(std::string name, int64_t epoch, int rank, std::vector<int> ranks)
      : name_(std::move(name)), epoch_(epoch), rank_(rank), ranks_(std::move(ranks)) {}

 private:
  const std::string name_;
  const int64_t epoch_;
  const int rank_;
  const std::vector<int> ranks_;
};

}  // namespace shardcoord

#endif  // SHARDCOORD_COMMUNICATOR_H_
