// The Gloo backend: CPU collectives over TCP, with the coordinator as rendezvous store.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <dlfcn.h>
#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm_base.h"

namespace shardcoord {

namespace internal {
namespace {

constexpr char kGlooHostEnv[] = "SHARDCOORD_GLOO_HOST";
// The Gloo library shardcoord is built against (Debian's libgloo-dev).
constexpr char kGlooLibrary[] = "libgloo.so.0";
// How long a failed collective waits for the coordinator's abort (which names the lost
// rank) before reporting the failure itself.
constexpr absl::Duration kPeerVerdictWait = absl::Seconds(1);

// Gloo's rendezvous store, backed by the epoch's store (at the coordinator).
// Gloo expects exceptions; the last failure is kept as a status for the caller.
class EpochStore final : public gloo::rendezvous::Store {
 public:
  EpochStore(EpochRendezvous& rendezvous, absl::Duration timeout) : rendezvous_(rendezvous), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(rendezvous_.Publish(key, std::string(data.begin(), data.end())));
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
    auto values = rendezvous_.Fetch(keys, timeout);
    Check(values.status());
    return *std::move(values);
  }

  void Check(const absl::Status& s) {
    if (s.ok()) return;
    last_status_ = s;
    throw gloo::IoException(std::string(s.message()));
  }

  EpochRendezvous& rendezvous_;
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

// Runs the communicator's Gloo operations, one at a time, on a thread of its own, so that an
// abort can end the caller's wait: Gloo cannot cancel an operation, and closing its
// connections does not wake one that is already waiting (its buffers only hear of errors the
// device loop reads from a peer). An abandoned operation ends by itself when a peer's socket
// closes or at the op timeout; it only touches the buffers it owns (copies: see Run) and the
// shared state below, so the communicator and the caller may be gone by then.
class OpThread {
 public:
  OpThread() : state_(std::make_shared<State>()) {
    std::thread([s = state_] { Loop(*s); }).detach();
  }
  ~OpThread() {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;  // The thread exits once its operation (if any) returns.
  }

  // Runs `op` on the thread and waits until it returned, or until Abandon() was called.
  // Returns nullopt when abandoned; otherwise the exception the operation threw, if any.
  std::optional<std::exception_ptr> Run(std::function<void()> op) {
    State& s = *state_;
    absl::MutexLock lock(&s.mu);
    if (s.abandoned) return std::nullopt;
    s.op = std::move(op);
    s.done = false;
    s.error = nullptr;
    auto finished = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.done || s.abandoned; };
    s.mu.Await(absl::Condition(&finished));
    if (!s.done) return std::nullopt;
    return s.error;
  }

  // Ends the wait of Run (now and later) without waiting for the operation.
  void Abandon() {
    absl::MutexLock lock(&state_->mu);
    state_->abandoned = true;
  }

 private:
  struct State {
    absl::Mutex mu;
    std::function<void()> op ABSL_GUARDED_BY(mu);
    bool done ABSL_GUARDED_BY(mu) = false;
    bool abandoned ABSL_GUARDED_BY(mu) = false;
    bool stop ABSL_GUARDED_BY(mu) = false;
    std::exception_ptr error ABSL_GUARDED_BY(mu);
  };

  static void Loop(State& s) {
    while (true) {
      std::function<void()> op;
      {
        absl::MutexLock lock(&s.mu);
        auto ready = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.op != nullptr || s.stop; };
        s.mu.Await(absl::Condition(&ready));
        if (s.op == nullptr) return;  // Stopped.
        op = std::move(s.op);
        s.op = nullptr;
      }
      std::exception_ptr error;
      try {
        op();
      } catch (...) {
        error = std::current_exception();
      }
      op = nullptr;  // Frees what the operation held (its buffers, the context) here.
      absl::MutexLock lock(&s.mu);
      s.done = true;
      s.error = error;
    }
  }

  std::shared_ptr<State> state_;
};

// A copy of a caller's buffer that an abandoned operation may keep writing into.
using Bytes = std::shared_ptr<std::vector<char>>;
Bytes CopyOf(const void* data, size_t n) {
  auto b = std::make_shared<std::vector<char>>(n);
  if (n > 0) std::memcpy(b->data(), data, n);
  return b;
}

// Gloo's functions must be the ones of the library shardcoord was built against. A LibTorch that
// carries its own Gloo (pip's wheels export several hundred gloo:: symbols from libtorch_cpu.so)
// interposes them when it comes before libgloo in the process's lookup order (a trainer linked
// `shardcoord_worker torch`: libgloo is only a dependency of a dependency), and two Gloo versions
// then share objects: a segfault in the first connect, seen with LibTorch 2.11 on the GPU
// machine. The function a call here binds to is compared with libgloo's own definition (dlsym on
// its handle); a process without libgloo loaded as its own library is not checked. Not cached: a
// library loaded later with RTLD_GLOBAL can interpose too, and a connect is rare.
absl::Status GlooIsItsOwnLibrary() {
  void* bound = reinterpret_cast<void*>(&gloo::transport::tcp::CreateDevice);
  Dl_info info{};
  if (dladdr(bound, &info) == 0 || info.dli_sname == nullptr) return absl::OkStatus();
  void* gloo = dlopen(kGlooLibrary, RTLD_LAZY | RTLD_NOLOAD);
  if (gloo == nullptr) return absl::OkStatus();
  void* own = dlsym(gloo, info.dli_sname);
  dlclose(gloo);
  if (own == nullptr || own == bound) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "Gloo's functions in this process come from ", info.dli_fname == nullptr ? "another library" : info.dli_fname,
      ", not from ", kGlooLibrary, ", the Gloo shardcoord was built against (a LibTorch that carries its own Gloo, "
      "such as pip's, linked before it): two Gloo versions cannot share a process. Link ", kGlooLibrary,
      " ahead of LibTorch: link -Wl,--push-state,--no-as-needed,-l:libgloo.so.0,--pop-state (one item) after "
      "the worker and before the Torch libraries (README, \"Using the worker library\"); or use the NCCL "
      "backend"));
}

class GlooCommunicator final : public CommunicatorBase {
 public:
  GlooCommunicator(std::shared_ptr<EpochRendezvous> rendezvous, CommSpec spec)
      : CommunicatorBase(std::move(rendezvous), std::move(spec)) {}

  absl::Status Connect() override {
    if (absl::Status s = GlooIsItsOwnLibrary(); !s.ok()) {
      // Reported, so that the coordinator aborts the epoch for the other members with this cause
      // instead of leaving them to their join timeout.
      const std::string error = absl::StrCat("rank ", spec().job_rank, ": ", s.message());
      (void)rendezvous().ReportError(error);
      return absl::Status(s.code(), absl::StrCat("communicator '", name(), "': ", s.message()));
    }
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
      ctx->setTimeout(absl::ToChronoMilliseconds(options().join_timeout));
      EpochStore store(rendezvous(), options().join_timeout);
      try {
        ctx->connectFullMesh(store, device_);
      } catch (const std::exception& e) {
        absl::Status s = store.last_status();
        if (!s.ok()) return s;  // The coordinator's own error (aborted epoch, deadline, ...).
        return absl::UnavailableError(absl::StrCat("communicator '", name(), "' epoch ", epoch(),
                                                   ": connecting to the other members failed: ", e.what()));
      }
      ctx->setTimeout(absl::ToChronoMilliseconds(options().op_timeout));
      absl::MutexLock lock(&mu_);
      if (AbortedLocked()) return AbortedStatusLocked();
      ctx_ = std::move(ctx);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("communicator '", name(), "': cannot set up Gloo: ", e.what()));
    }
    return rendezvous().ReportReady();
  }

  void AbortBackend() override {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    {
      absl::MutexLock lock(&mu_);
      ctx = ctx_;
    }
    // An operation in flight returns ABORTED to its caller now; it ends in the background,
    // and its end closes the connections (see Run). Without one, close them now: peers
    // blocked on us see EOF at once.
    ops_.Abandon();
    bool running;
    {
      absl::MutexLock lock(&op_end_->mu);
      op_end_->aborted = true;
      running = op_end_->running;
    }
    if (ctx && !running) ctx->closeConnections();
  }

  bool ConnectedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) override { return ctx_ != nullptr; }

  absl::Status AllGather(const void* in, void* out, size_t count, DataType type) override {
    const size_t n = count * DataTypeSize(type);
    Bytes in_copy = CopyOf(in, n);
    Bytes out_copy = std::make_shared<std::vector<char>>(n * size());
    const int members = size();
    const auto timeout = absl::ToChronoMilliseconds(options().op_timeout);
    absl::Status s = Run("all_gather", [=](const std::shared_ptr<gloo::Context>& ctx) {
      Dispatch(type, [&](auto t) {
        using T = decltype(t);
        gloo::AllgatherOptions opts(ctx);
        opts.setInput(reinterpret_cast<T*>(in_copy->data()), count);
        opts.setOutput(reinterpret_cast<T*>(out_copy->data()), count * members);
        opts.setTimeout(timeout);
        gloo::allgather(opts);
      });
    });
    if (s.ok() && !out_copy->empty()) std::memcpy(out, out_copy->data(), out_copy->size());
    return s;
  }

  absl::Status AllReduce(void* data, size_t count, DataType type, ReduceOp op) override {
    Bytes buf = CopyOf(data, count * DataTypeSize(type));
    const auto timeout = absl::ToChronoMilliseconds(options().op_timeout);
    absl::Status s = Run("all_reduce", [=](const std::shared_ptr<gloo::Context>& ctx) {
      Dispatch(type, [&](auto t) {
        using T = decltype(t);
        gloo::AllreduceOptions opts(ctx);
        opts.setOutput(reinterpret_cast<T*>(buf->data()), count);
        SetReduce<T>(opts, op);
        opts.setTimeout(timeout);
        gloo::allreduce(opts);
      });
    });
    if (s.ok() && !buf->empty()) std::memcpy(data, buf->data(), buf->size());
    return s;
  }

  absl::Status Broadcast(void* data, size_t count, DataType type, int root) override {
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " outside 0..", size() - 1));
    }
    Bytes buf = CopyOf(data, count * DataTypeSize(type));
    const auto timeout = absl::ToChronoMilliseconds(options().op_timeout);
    absl::Status s = Run("broadcast", [=](const std::shared_ptr<gloo::Context>& ctx) {
      Dispatch(type, [&](auto t) {
        using T = decltype(t);
        gloo::BroadcastOptions opts(ctx);
        opts.setRoot(root);
        opts.setOutput(reinterpret_cast<T*>(buf->data()), count);
        opts.setTimeout(timeout);
        gloo::broadcast(opts);
      });
    });
    if (s.ok() && !buf->empty()) std::memcpy(data, buf->data(), buf->size());
    return s;
  }

  absl::Status Barrier() override {
    const auto timeout = absl::ToChronoMilliseconds(options().op_timeout);
    return Run("barrier", [=](const std::shared_ptr<gloo::Context>& ctx) {
      gloo::BarrierOptions opts(ctx);
      opts.setTimeout(timeout);
      gloo::barrier(opts);
    });
  }

 private:
  // Runs `f` (which may only use what it owns: it can outlive this call) on the op thread.
  absl::Status Run(const char* what, std::function<void(const std::shared_ptr<gloo::Context>&)> f) {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    {
      absl::MutexLock lock(&mu_);
      if (absl::Status s = UsableLocked(); !s.ok()) return s;
      ctx = ctx_;
      absl::MutexLock end_lock(&op_end_->mu);
      op_end_->running = true;
    }
    CountIssued();
    // The operation's end, on the op thread: if an abort came meanwhile, close the
    // connections now that nothing waits on them (peers blocked on us then see EOF). Exactly
    // one of Abort and this end closes them (op_end_ decides, under its lock).
    auto op = [ctx, f = std::move(f), end = op_end_]() {
      struct OnEnd {
        const std::shared_ptr<gloo::rendezvous::Context>& ctx;
        const std::shared_ptr<OpEnd>& end;
        ~OnEnd() {
          bool aborted;
          {
            absl::MutexLock lock(&end->mu);
            end->running = false;
            aborted = end->aborted;
          }
          if (aborted) ctx->closeConnections();
        }
      } on_end{ctx, end};
      f(ctx);
    };
    std::optional<std::exception_ptr> result = ops_.Run(std::move(op));
    CountCompleted();
    bool aborted;
    {
      absl::MutexLock lock(&mu_);
      aborted = AbortedLocked();
    }
    // Abandoned by Abort: the operation ends in the background.
    if (!result.has_value()) return AbortedStatus();
    if (*result == nullptr) return absl::OkStatus();  // Completed: valid even if an abort came meanwhile.
    if (aborted) return AbortedStatus();
    std::string error;
    try {
      std::rethrow_exception(*result);
    } catch (const std::exception& e) {
      error = absl::StrCat(what, " failed: ", e.what());
    } catch (...) {
      error = absl::StrCat(what, " failed");
    }
    // A peer's socket closing usually means the peer died; the coordinator sees its stream
    // end at the same moment and its abort names the rank. Give that verdict a moment.
    if (AwaitAbort(kPeerVerdictWait)) return AbortedStatus();
    // Our own failure (a peer vanished, a timeout): the coordinator aborts the epoch for everyone.
    return FailEpoch(error);
  }

  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_ ABSL_GUARDED_BY(mu_);
  // Shared with the operation in flight, which may end after this communicator is gone.
  struct OpEnd {
    absl::Mutex mu;
    bool running ABSL_GUARDED_BY(mu) = false;
    bool aborted ABSL_GUARDED_BY(mu) = false;
  };
  std::shared_ptr<OpEnd> op_end_ = std::make_shared<OpEnd>();
  OpThread ops_;
};

}  // namespace

std::shared_ptr<AbortableCommunicator> MakeGlooCommunicator(std::shared_ptr<EpochRendezvous> rendezvous,
                                                            CommSpec spec) {
  return std::make_shared<GlooCommunicator>(std::move(rendezvous), std::move(spec));
}

}  // namespace internal
}  // namespace shardcoord
