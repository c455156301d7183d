// A rank process for the communicator tests: registers with the coordinator, opens a
// communicator through it and runs a loop of checked Gloo collectives.
//
//   comm_rank --coordinator ADDR --job J --rank R --world-size W --group-size G
//             --comm world|group --iterations N [--interval-ms M] [--rejoin]
//             [--stall-at I --stall-ms MS [--stall-until FILE]] [--op-timeout-ms MS]
//
// Each iteration: all-gather of (job rank * 1000 + iteration), all-reduce(SUM) of
// (job rank + 1), broadcast from member 0; every result is checked. With --rejoin, an
// aborted communicator is opened again (the next epoch) and the members agree, with an
// all-reduce(MAX), on the iteration to resume from. Prints "iteration I epoch E ok" lines.
// Exit codes: 0 done; 3 a collective failed (message on stderr); 4 wrong result.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <thread>

#include "shardcoord/worker.h"

#ifdef SHARDCOORD_HAVE_NCCL
#include <cuda_runtime.h>
#endif

namespace {

// Where collective buffers live: host memory for Gloo, device memory for NCCL. Values are
// staged through the host so the checks below are the same for both backends.
class Buffers {
 public:
  explicit Buffers(bool device) : device_(device) {}
  ~Buffers() {
#ifdef SHARDCOORD_HAVE_NCCL
    for (void* p : allocated_) cudaFree(p);
#endif
  }
  // A buffer of `bytes` initialised from `host`.
  void* Put(const void* host, size_t bytes) {
    if (!device_) return const_cast<void*>(host);
#ifdef SHARDCOORD_HAVE_NCCL
    void* d = nullptr;
    if (cudaMalloc(&d, bytes) != cudaSuccess) std::abort();
    cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice);
    allocated_.push_back(d);
    return d;
#else
    std::abort();
#endif
  }
  void Get(void* host, const void* buf, size_t bytes) {
    if (!device_) return;
#ifdef SHARDCOORD_HAVE_NCCL
    cudaMemcpy(host, buf, bytes, cudaMemcpyDeviceToHost);
#endif
  }

 private:
  bool device_;
  std::vector<void*> allocated_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"comm_rank"};
  std::string address, job, comm_name = "world";
  int rank = 0, world = 0, group_size = 0, iterations = 10, interval_ms = 0;
  bool rejoin = false;
  int stall_at = -1, stall_ms = 0, op_timeout_ms = 10000, device = -1;
  std::string backend = "gloo", stall_until;
  app.add_option("--coordinator", address)->required();
  app.add_option("--job", job)->required();
  app.add_option("--rank", rank)->required();
  app.add_option("--world-size", world)->required();
  app.add_option("--group-size", group_size)->required();
  app.add_option("--comm", comm_name);
  app.add_option("--iterations", iterations);
  app.add_option("--interval-ms", interval_ms);
  app.add_flag("--rejoin", rejoin);
  app.add_option("--stall-at", stall_at, "before this iteration, stop issuing collectives for --stall-ms");
  app.add_option("--stall-ms", stall_ms, "longest stall");
  app.add_option("--stall-until", stall_until,
                 "end the stall as soon as this file exists (a test's signal), at the latest after --stall-ms");
  app.add_option("--op-timeout-ms", op_timeout_ms);
  app.add_option("--backend", backend)->check(CLI::IsMember({"gloo", "nccl"}));
  app.add_option("--device", device, "CUDA device for --backend nccl (default: rank % device count)");
  CLI11_PARSE(app, argc, argv);

  shardcoord::WorkerOptions o;
  o.coordinator_address = address;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.group_size = group_size;
  o.modules = {{"vision_tower", 1024, {}, false}};
  o.connect_timeout = absl::Seconds(20);
  auto worker = shardcoord::Worker::Connect(o);
  if (!worker.ok()) {
    std::cerr << "connect: " << worker.status() << "\n";
    return 3;
  }
  shardcoord::CommunicatorOptions co;
  co.name = comm_name;
  co.join_timeout = absl::Seconds(30);
  co.op_timeout = absl::Milliseconds(op_timeout_ms);
  const bool nccl = backend == "nccl";
  if (nccl) {
    co.backend = shardcoord::Backend::kNccl;
#ifdef SHARDCOORD_HAVE_NCCL
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      std::cerr << "no CUDA device\n";
      return 3;
    }
    co.cuda_device = device >= 0 ? device : rank % count;
    cudaSetDevice(co.cuda_device);
#endif
  }

  auto open = [&]() -> std::shared_ptr<shardcoord::Communicator> {
    auto c = (*worker)->OpenCommunicator(co);
    if (!c.ok()) {
      std::cerr << "open " << comm_name << ": " << c.status() << "\n";
      return nullptr;
    }
    return *c;
  };
  auto comm = open();
  if (!comm) return 3;

  int64_t it = 0;
  bool agree = true;  // Agree on the iteration to (re)start from after each (re)join.
  while (it < iterations) {
    absl::Status s;
    Buffers bufs(nccl);
    if (agree) {
      int64_t next = it;
      void* b = bufs.Put(&next, sizeof(next));
      s = comm->AllReduce(b, 1, shardcoord::DataType::kInt64, shardcoord::ReduceOp::kMax);
      bufs.Get(&next, b, sizeof(next));
      if (s.ok()) {
        it = next;
        agree = false;
      }
    }
    if (s.ok() && it == stall_at && stall_ms > 0) {
      stall_at = -1;  // Alive and heartbeating, but not issuing collectives.
      std::cerr << "stalling before iteration " << it << " for at most " << stall_ms << " ms" << std::endl;
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(stall_ms);
      while (std::chrono::steady_clock::now() < until &&
             (stall_until.empty() || access(stall_until.c_str(), F_OK) != 0)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    if (s.ok()) {
      const int n = comm->size();
      std::vector<int64_t> mine = {rank * 1000 + it}, all(n);
      void* in = bufs.Put(mine.data(), sizeof(int64_t));
      void* out = bufs.Put(all.data(), n * sizeof(int64_t));
      s = comm->AllGather(in, out, 1, shardcoord::DataType::kInt64);
      bufs.Get(all.data(), out, n * sizeof(int64_t));
      for (int i = 0; s.ok() && i < n; ++i) {
        if (all[i] != comm->ranks()[i] * 1000 + it) {
          std::cerr << "WRONG all_gather at iteration " << it << ": member " << i << " gave " << all[i] << "\n";
          return 4;
        }
      }
      int64_t sum = rank + 1;
      void* sb = bufs.Put(&sum, sizeof(sum));
      if (s.ok()) s = comm->AllReduce(sb, 1, shardcoord::DataType::kInt64, shardcoord::ReduceOp::kSum);
      bufs.Get(&sum, sb, sizeof(sum));
      int64_t expect = 0;
      for (int r : comm->ranks()) expect += r + 1;
      if (s.ok() && sum != expect) {
        std::cerr << "WRONG all_reduce at iteration " << it << ": " << sum << " != " << expect << "\n";
        return 4;
      }
      float value = comm->rank() == 0 ? static_cast<float>(it) + 0.5f : -1.0f;
      void* vb = bufs.Put(&value, sizeof(value));
      if (s.ok()) s = comm->Broadcast(vb, 1, shardcoord::DataType::kFloat32, 0);
      bufs.Get(&value, vb, sizeof(value));
      if (s.ok() && value != static_cast<float>(it) + 0.5f) {
        std::cerr << "WRONG broadcast at iteration " << it << ": " << value << "\n";
        return 4;
      }
    }
    if (!s.ok()) {
      std::cerr << "iteration " << it << " epoch " << comm->epoch() << ": " << s << "\n";
      if (!rejoin || s.code() != absl::StatusCode::kAborted) return 3;
      comm = open();
      if (!comm) return 3;
      agree = true;
      continue;
    }
    std::cout << "iteration " << it << " epoch " << comm->epoch() << " ok" << std::endl;
    ++it;
    if (interval_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
  }
  (*worker)->Close();
  return 0;
}
