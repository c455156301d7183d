// The Gloo backend: CPU collectives over TCP, with the coordinator as rendezvous store.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "communicator_internal.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord {

namespace internal {
namespace {

// Extra time a unary RPC gets beyond the wait it asks the coordinator for.
constexpr char kGlooHostEnv[] = "SHARDCOORD_GLOO_HOST";
// How long a failed collective waits for the coordinator's abort (which names the lost
// rank) before reporting the failure itself.
constexpr absl::Duration kPeerVerdictWait = absl::Seconds(1);

// Gloo's rendezvous store, backed by the coordinator's per-(communicator, epoch) store.
// Gloo expects exceptions; the last failure is kept as a status for the caller.
class CoordinatorStore final : public gloo::rendezvous::Store {
 public:
  CoordinatorStore(const CommEndpoint& ep, std::string name, int64_t epoch, absl::Duration timeout)
      : ep_(ep), name_(std::move(name)), epoch_(epoch), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(StorePublish(ep_, name_, epoch_, key, std::string(data.begin(), data.end())));
  }

  std::vector<char> get(const std::string& key) override {
    auto values = Get({key}, timeout_);
    return std::vector<char>(values[0].begin(), values[0].end());
  }

  void wait(const std::vector<std::string>& keys) override { Get(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    Get(keys, absl::FromChrono(timeout));
  }

  absl::Status last_status() const { return last_status_; }

 private:
  std::vector<std::string> Get(const std::vector<std::string>& keys, absl::Duration timeout) {
    auto values = StoreFetch(ep_, name_, epoch_, keys, timeout);
    Check(values.status());
    return *std::move(values);
  }

  void Check(const absl::Status& s) {
    if (s.ok()) return;
    last_status_ = s;
    throw gloo::IoException(std::string(s.message()));
  }

  const CommEndpoint ep_;
  const std::string name_;
  const int64_t epoch_;
  const absl::Duration timeout_;
  absl::Status last_status_;
};

template <typename T>
void SetReduce(gloo::AllreduceOptions& opts, ReduceOp op) {
  using Fn = void (*)(void*, const void*, const void*, size_t);
  switch (op) {
    case ReduceOp::kSum: opts.setReduceFunction(static_cast<Fn>(&gloo::sum<T>)); break;
    case ReduceOp::kMax: opts.setReduceFunction(static_cast<Fn>(&gloo::max<T>)); break;
    case ReduceOp::kMin: opts.setReduceFunction(static_cast<Fn>(&gloo::min<T>)); break;
  }
}

// Calls f.template operator()<T>() for the C++ type of `type`.
template <typename F>
void Dispatch(DataType type, F&& f) {
  switch (type) {
    case DataType::kFloat32: f(float{}); break;
    case DataType::kFloat64: f(double{}); break;
    case DataType::kInt32: f(int32_t{}); break;
    case DataType::kInt64: f(int64_t{}); break;
    case DataType::kUint8: f(uint8_t{}); break;
  }
}

class GlooCommunicator final : public AbortableCommunicator {
 public:
  GlooCommunicator(const CommEndpoint& ep, const std::string& name, int64_t epoch, std::vector<int> ranks,
                   int index, const CommunicatorOptions& options)
      : AbortableCommunicator(name, epoch, index, std::move(ranks)), ep_(ep), options_(options) {}

  absl::Status Connect() override {
    try {
      gloo::transport::tcp::attr attr;
      const char* host = std::getenv(kGlooHostEnv);
      if (host != nullptr && *host != '\0') {
        attr.hostname = host;
      } else {
        char buf[256] = {0};
        attr.hostname = gethostname(buf, sizeof(buf) - 1) == 0 ? buf : "127.0.0.1";
      }
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank(), size());
      ctx->setTimeout(absl::ToChronoMilliseconds(options_.join_timeout));
      CoordinatorStore store(ep_, name(), epoch(), options_.join_timeout);
      try {
        ctx->connectFullMesh(store, device_);
      } catch (const std::exception& e) {
        absl::Status s = store.last_status();
        if (!s.ok()) return s;  // The coordinator's own error (aborted epoch, deadline, ...).
        return absl::UnavailableError(absl::StrCat("communicator '", name(), "' epoch ", epoch(),
                                                   ": connecting to the other members failed: ", e.what()));
      }
      ctx->setTimeout(absl::ToChronoMilliseconds(options_.op_timeout));
      absl::MutexLock lock(&mu_);
      if (!abort_reason_.empty()) return AbortedStatusLocked();
      ctx_ = std::move(ctx);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("communicator '", name(), "': cannot set up Gloo: ", e.what()));
    }
    return ReportComm(ep_, name(), epoch(), v1::CommReportRequest::KIND_READY, "");
  }

  void Abort(const std::string& reason) override {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    {
      absl::MutexLock lock(&mu_);
      if (!abort_reason_.empty()) return;
      abort_reason_ = reason;
      if (!in_flight_) ctx = ctx_;
    }
    logging::Get("worker")->warn("job={} rank={} comm={} epoch={} aborting: {}", ep_.job_id, ep_.job_rank, name(),
                                 epoch(), reason);
    // Closing our connections makes peers blocked on us fail at once (they see EOF). Gloo
    // does not wake an operation of our own that is in flight when we close under it, so
    // then the operation's end closes them (see Run); it fails through the peers' EOF, or
    // at the op timeout at the latest.
    if (ctx) ctx->closeConnections();
  }

  void Progress(int64_t* issued, int64_t* completed) const override {
    *issued = issued_.load(std::memory_order_relaxed);
    *completed = completed_.load(std::memory_order_relaxed);
  }

  absl::Status Health() const override {
    absl::MutexLock lock(&mu_);
    if (!abort_reason_.empty()) return AbortedStatusLocked();
    if (!ctx_) return absl::FailedPreconditionError("communicator is not connected");
    return absl::OkStatus();
  }

  absl::Status AllGather(const void* in, void* out, size_t count, DataType type) override {
    return Run("all_gather", [&](auto& ctx) {
      Dispatch(type, [&](auto t) {
        using T = decltype(t);
        gloo::AllgatherOptions opts(ctx);
        opts.setInput(const_cast<T*>(static_cast<const T*>(in)), count);
        opts.setOutput(static_cast<T*>(out), count * size());
        opts.setTimeout(absl::ToChronoMilliseconds(options_.op_timeout));
        gloo::allgather(opts);
      });
    });
  }

  absl::Status AllReduce(void* data, size_t count, DataType type, ReduceOp op) override {
    return Run("all_reduce", [&](auto& ctx) {
      Dispatch(type, [&](auto t) {
        using T = decltype(t);
        gloo::AllreduceOptions opts(ctx);
        opts.setOutput(static_cast<T*>(data), count);
        SetReduce<T>(opts, op);
        opts.setTimeout(absl::ToChronoMilliseconds(options_.op_timeout));
        gloo::allreduce(opts);
      });
    });
  }

  absl::Status Broadcast(void* data, size_t count, DataType type, int root) override {
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " outside 0..", size() - 1));
    }
    return Run("broadcast", [&](auto& ctx) {
      Dispatch(type, [&](auto t) {
        using T = decltype(t);
        gloo::BroadcastOptions opts(ctx);
        opts.setRoot(root);
        opts.setOutput(static_cast<T*>(data), count);
        opts.setTimeout(absl::ToChronoMilliseconds(options_.op_timeout));
        gloo::broadcast(opts);
      });
    });
  }

  absl::Status Barrier() override {
    return Run("barrier", [&](auto& ctx) {
      gloo::BarrierOptions opts(ctx);
      opts.setTimeout(absl::ToChronoMilliseconds(options_.op_timeout));
      gloo::barrier(opts);
    });
  }

 private:
  absl::Status AbortedStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::AbortedError(absl::StrCat("communicator '", name(), "' epoch ", epoch(),
                                           " was aborted: ", abort_reason_,
                                           "; open it again to join the next epoch"));
  }

  template <typename F>
  absl::Status Run(const char* what, F&& f) {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    {
      absl::MutexLock lock(&mu_);
      if (!abort_reason_.empty()) return AbortedStatusLocked();
      if (!ctx_) return absl::FailedPreconditionError("communicator is not connected");
      ctx = ctx_;
      in_flight_ = true;
    }
    issued_.fetch_add(1, std::memory_order_relaxed);
    // Ends the operation; closes the connections if an abort arrived meanwhile.
    auto finish = [&]() -> bool {
      completed_.fetch_add(1, std::memory_order_relaxed);
      bool aborted;
      {
        absl::MutexLock lock(&mu_);
        in_flight_ = false;
        aborted = !abort_reason_.empty();
      }
      if (aborted) ctx->closeConnections();
      return aborted;
    };
    try {
      f(ctx);
      finish();  // Completed: its result is valid even if an abort arrived meanwhile.
      return absl::OkStatus();
    } catch (const std::exception& e) {
      if (finish()) {
        absl::MutexLock lock(&mu_);
        return AbortedStatusLocked();
      }
      // A peer's socket closing usually means the peer died; the coordinator sees its stream
      // end at the same moment and its abort names the rank. Give that verdict a moment.
      {
        absl::MutexLock lock(&mu_);
        auto verdict = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !abort_reason_.empty(); };
        mu_.AwaitWithTimeout(absl::Condition(&verdict), kPeerVerdictWait);
        if (!abort_reason_.empty()) return AbortedStatusLocked();
      }
      // Our own failure (a peer vanished, a timeout): the coordinator aborts the epoch for
      // everyone. If it already did (it saw the peer die), its answer names the cause.
      const std::string error = absl::StrCat(what, " failed: ", e.what());
      absl::Status report = ReportComm(ep_, name(), epoch(), v1::CommReportRequest::KIND_ERROR, error);
      Abort(report.code() == absl::StatusCode::kAborted ? std::string(report.message()) : error);
      absl::MutexLock lock(&mu_);
      return AbortedStatusLocked();
    }
  }

  const CommEndpoint ep_;
  const CommunicatorOptions options_;
  std::shared_ptr<gloo::transport::Device> device_;
  mutable absl::Mutex mu_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_ ABSL_GUARDED_BY(mu_);
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> completed_{0};
};

}  // namespace

std::shared_ptr<AbortableCommunicator> MakeGlooCommunicator(const CommEndpoint& endpoint, const std::string& name,
                                                            int64_t epoch, std::vector<int> ranks,
                                                            const CommunicatorOptions& options) {
  const int index = static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), endpoint.job_rank) - ranks.begin());
  return std::make_shared<GlooCommunicator>(endpoint, name, epoch, std::move(ranks), index, options);
}

}  // namespace internal
}  // namespace shardcoord
