// The NCCL backend (built with SHARDCOORD_WITH_NCCL): GPU collectives whose unique id goes
// through the coordinator's per-(communicator, epoch) store.
//
// Communicators are created nonblocking (config.blocking = 0) with a deadline on init, so
// that every wait can be abandoned: init, each collective and the stream are polled, never
// waited on. On an abort (the coordinator's, or our own failure) the communicator is
// aborted with ncclCommAbort, never destroyed while failed; the next epoch is a new one.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm_base.h"

// Every NCCL / CUDA call is checked; the status names the call, the file and the line.
#define SHARDCOORD_NCCL_CHECK(call)                                                                  \
  do {                                                                                               \
    ncclResult_t _r = (call);                                                                        \
    if (_r != ncclSuccess && _r != ncclInProgress) {                                                 \
      return absl::InternalError(absl::StrCat(#call, " failed at ", __FILE__, ":", __LINE__, ": ",  \
                                              ncclGetErrorString(_r)));                              \
    }                                                                                                \
  } while (0)
#define SHARDCOORD_CUDA_CHECK(call)                                                                  \
  do {                                                                                               \
    cudaError_t _e = (call);                                                                         \
    if (_e != cudaSuccess) {                                                                         \
      return absl::InternalError(absl::StrCat(#call, " failed at ", __FILE__, ":", __LINE__, ": ",  \
                                              cudaGetErrorString(_e)));                              \
    }                                                                                                \
  } while (0)

namespace shardcoord::internal {
namespace {

constexpr absl::Duration kPoll = absl::Microseconds(50);
constexpr char kUniqueIdKey[] = "nccl_unique_id";

ncclDataType_t ToNccl(DataType t) {
  switch (t) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kUint8: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

class NcclCommunicator final : public CommunicatorBase {
 public:
  NcclCommunicator(std::shared_ptr<EpochRendezvous> rendezvous, CommSpec spec)
      : CommunicatorBase(std::move(rendezvous), std::move(spec)) {}

  ~NcclCommunicator() override {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return;
    // A failed or aborted communicator is aborted, never destroyed (NCCL's rule).
    if (AbortedLocked() || failed_) {
      if (!aborted_) ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Connect() override {
    SHARDCOORD_CUDA_CHECK(cudaSetDevice(options().cuda_device));
    SHARDCOORD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    SHARDCOORD_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(int32_t)));
    SHARDCOORD_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    ncclUniqueId id;
    if (rank() == 0) {
      // The group's lowest rank creates the id and publishes it through the coordinator.
      SHARDCOORD_NCCL_CHECK(ncclGetUniqueId(&id));
      absl::Status s = rendezvous().Publish(kUniqueIdKey, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
      if (!s.ok()) return s;
    } else {
      auto values = rendezvous().Fetch({kUniqueIdKey}, options().join_timeout);
      if (!values.ok()) return values.status();
      if ((*values)[0].size() != sizeof(id)) {
        return absl::DataLossError(absl::StrCat("communicator '", name(), "': the published NCCL unique id has ",
                                                (*values)[0].size(), " bytes, expected ", sizeof(id)));
      }
      std::memcpy(&id, (*values)[0].data(), sizeof(id));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // Nonblocking, so init and every collective can be abandoned.
    ncclComm_t comm = nullptr;
    SHARDCOORD_NCCL_CHECK(ncclCommInitRankConfig(&comm, size(), id, rank(), &config));
    {
      absl::MutexLock lock(&mu_);
      comm_ = comm;
    }
    absl::Status s = WaitComm(comm, absl::Now() + options().join_timeout, "ncclCommInitRankConfig");
    if (!s.ok()) return s;
    return rendezvous().ReportReady();
  }

  // ncclCommAbort runs under mu_: it must not race an operation's own abort (Run).
  void AbortBackend() override {
    absl::MutexLock lock(&mu_);
    // With an operation in flight, its polling loop aborts (it owns the communicator then).
    if (!in_flight_ && comm_ != nullptr && !aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
  }

  bool ConnectedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) override { return comm_ != nullptr; }

  absl::Status AllGather(const void* in, void* out, size_t count, DataType type) override {
    return Run("ncclAllGather",
               [&](ncclComm_t c) { return ncclAllGather(in, out, count, ToNccl(type), c, stream_); });
  }
  absl::Status AllReduce(void* data, size_t count, DataType type, ReduceOp op) override {
    return Run("ncclAllReduce",
               [&](ncclComm_t c) { return ncclAllReduce(data, data, count, ToNccl(type), ToNccl(op), c, stream_); });
  }
  absl::Status Broadcast(void* data, size_t count, DataType type, int root) override {
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " outside 0..", size() - 1));
    }
    return Run("ncclBroadcast",
               [&](ncclComm_t c) { return ncclBroadcast(data, data, count, ToNccl(type), root, c, stream_); });
  }
  absl::Status Barrier() override {
    return Run("barrier",
               [&](ncclComm_t c) { return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, c, stream_); });
  }

 private:
  // Polls the communicator's async state until it leaves ncclInProgress, the deadline
  // passes or an abort arrives; aborts the communicator in the last two cases. `comm` is
  // comm_, read under mu_ by the caller: it is set once, before any operation, and only the
  // destructor releases it.
  absl::Status WaitComm(ncclComm_t comm, absl::Time deadline, const char* what) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm, &state);
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Fail(absl::StrCat(what, ": ", ncclGetErrorString(state)));
      if (absl::Status s = CheckAbortOrDeadline(deadline, what); !s.ok()) return s;
      absl::SleepFor(kPoll);
    }
  }

  absl::Status CheckAbortOrDeadline(absl::Time deadline, const char* what) {
    absl::MutexLock lock(&mu_);
    if (AbortedLocked()) {
      if (!aborted_) {
        ncclCommAbort(comm_);
        aborted_ = true;
      }
      return AbortedStatusLocked();
    }
    if (absl::Now() > deadline) {
      failed_ = true;
      return absl::DeadlineExceededError(absl::StrCat(what, " on communicator '", name(), "' did not finish within ",
                                                      absl::ToInt64Milliseconds(options().op_timeout), " ms"));
    }
    return absl::OkStatus();
  }

  // Our own failure: reported, the epoch aborted, and the communicator with it (an
  // operation in flight owns it, so AbortBackend left it to us).
  absl::Status Fail(const std::string& error) {
    absl::Status aborted = FailEpoch(error);
    absl::MutexLock lock(&mu_);
    if (!aborted_ && comm_ != nullptr) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
    return aborted;
  }

  template <typename F>
  absl::Status Run(const char* what, F&& launch) {
    ncclComm_t comm = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (absl::Status s = UsableLocked(); !s.ok()) return s;
      in_flight_ = true;  // This thread owns the communicator until in_flight_ is false again.
      comm = comm_;
    }
    CountIssued();
    absl::Status s = RunInFlight(what, comm, launch);
    CountCompleted();
    absl::MutexLock lock(&mu_);
    in_flight_ = false;
    if (AbortedLocked() && !aborted_ && comm_ != nullptr) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
    return s;
  }

  template <typename F>
  absl::Status RunInFlight(const char* what, ncclComm_t comm, F&& launch) {
    const absl::Time deadline = absl::Now() + options().op_timeout;
    // Order after the work the caller queued on the default stream (e.g. LibTorch filling
    // the input), without blocking the host.
    if (cudaEventRecord(ready_, cudaStreamLegacy) != cudaSuccess ||
        cudaStreamWaitEvent(stream_, ready_, 0) != cudaSuccess) {
      return Fail("cannot order the collective after the default stream");
    }
    ncclResult_t r = launch(comm);
    if (r != ncclSuccess && r != ncclInProgress) return Fail(absl::StrCat(what, ": ", ncclGetErrorString(r)));
    if (absl::Status s = WaitComm(comm, deadline, what); !s.ok()) return s;
    // The kernel is queued: poll the stream, so a hung peer cannot block us past the deadline.
    while (true) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Fail(absl::StrCat(what, ": ", cudaGetErrorString(e)));
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        return Fail(absl::StrCat(what, ": ", ncclGetErrorString(state)));
      }
      if (absl::Status s = CheckAbortOrDeadline(deadline, what); !s.ok()) {
        if (s.code() == absl::StatusCode::kDeadlineExceeded) return Fail(std::string(s.message()));
        return s;
      }
      absl::SleepFor(kPoll);
    }
  }

  cudaStream_t stream_ = nullptr;
  int32_t* scratch_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;  // ncclCommAbort was called.
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

std::shared_ptr<AbortableCommunicator> MakeNcclCommunicator(std::shared_ptr<EpochRendezvous> rendezvous,
                                                            CommSpec spec) {
  return std::make_shared<NcclCommunicator>(std::move(rendezvous), std::move(spec));
}

}  // namespace shardcoord::internal
