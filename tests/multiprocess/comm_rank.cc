// A rank process for the communicator tests: registers with the coordinator, opens a
// communicator through it and runs a loop of checked Gloo collectives.
//
//   comm_rank --coordinator ADDR --job J --rank R --world-size W --group-size G
//             --comm world|group --iterations N [--interval-ms M] [--rejoin]
//             [--stall-at I --stall-ms MS] [--op-timeout-ms MS]
//
// Each iteration: all-gather of (job rank * 1000 + iteration), all-reduce(SUM) of
// (job rank + 1), broadcast from member 0; every result is checked. With --rejoin, an
// aborted communicator is opened again (the next epoch) and the members agree, with an
// all-reduce(MAX), on the iteration to resume from. Prints "iteration I epoch E ok" lines.
// Exit codes: 0 done; 3 a collective failed (message on stderr); 4 wrong result.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <thread>

#include "shardcoord/worker.h"

int main(int argc, char** argv) {
  CLI::App app{"comm_rank"};
  std::string address, job, comm_name = "world";
  int rank = 0, world = 0, group_size = 0, iterations = 10, interval_ms = 0;
  bool rejoin = false;
  int stall_at = -1, stall_ms = 0, op_timeout_ms = 10000;
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
  app.add_option("--stall-ms", stall_ms);
  app.add_option("--op-timeout-ms", op_timeout_ms);
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
    if (agree) {
      int64_t next = it;
      s = comm->AllReduce(&next, 1, shardcoord::ReduceOp::kMax);
      if (s.ok()) {
        it = next;
        agree = false;
      }
    }
    if (s.ok() && it == stall_at && stall_ms > 0) {
      stall_at = -1;  // Alive and heartbeating, but not issuing collectives.
      std::cerr << "stalling before iteration " << it << " for " << stall_ms << " ms" << std::endl;
      std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    }
    if (s.ok()) {
      const int n = comm->size();
      std::vector<int64_t> mine = {rank * 1000 + it}, all(n);
      s = comm->AllGather(mine.data(), all.data(), 1, shardcoord::DataType::kInt64);
      for (int i = 0; s.ok() && i < n; ++i) {
        if (all[i] != comm->ranks()[i] * 1000 + it) {
          std::cerr << "WRONG all_gather at iteration " << it << ": member " << i << " gave " << all[i] << "\n";
          return 4;
        }
      }
      int64_t sum = rank + 1;
      if (s.ok()) s = comm->AllReduce(&sum, 1, shardcoord::ReduceOp::kSum);
      int64_t expect = 0;
      for (int r : comm->ranks()) expect += r + 1;
      if (s.ok() && sum != expect) {
        std::cerr << "WRONG all_reduce at iteration " << it << ": " << sum << " != " << expect << "\n";
        return 4;
      }
      float value = comm->rank() == 0 ? static_cast<float>(it) + 0.5f : -1.0f;
      if (s.ok()) s = comm->Broadcast(&value, 1, shardcoord::DataType::kFloat32, 0);
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
