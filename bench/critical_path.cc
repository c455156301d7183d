// critical_path: what each approach costs a trainer on the critical path, per microbatch,
// measured in one run for one shard group of G ranks (threads of this process, talking
// over loopback TCP).
//
// - shardcoord, lookahead L: the trainer planned L microbatches ahead; right before
//   microbatch k it calls GetDecision(k). Normally a pop from the local queue.
// - shardcoord, no lookahead: ReportPlan(k) then GetDecision(k): one coordinator round trip
//   that also waits for the slowest rank of the group.
// - baseline, in-band all-reduce: the Qwen3-VL workaround, an all-reduce(MAX) of a
//   modality bitmask over the group before every microbatch (Gloo, TCP, loopback).
//
// Each rank "computes" (sleeps) for --compute-us between microbatches, as a trainer would.
//
//   critical_path --group-size 8 --microbatches 2000 --compute-us 1000
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/server/coordinator_server.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/worker.h"

namespace {

struct Stats {
  double p50_us = 0, p99_us = 0, mean_us = 0;
};

Stats Summarize(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.p50_us = v[v.size() / 2];
  s.p99_us = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  double sum = 0;
  for (double x : v) sum += x;
  s.mean_us = sum / v.size();
  return s;
}

// Sleeps: 8 busy ranks on this 2-core machine would measure the scheduler instead. The
// sleep lies outside the measured interval.
void Compute(absl::Duration d) { absl::SleepFor(d); }

int VisionCalls(int rank, int k) { return (k % 3 == 0) ? 1 : (k % 3 == 1) ? 0 : rank % 2; }

std::vector<double> RunShardcoord(const std::string& address, const std::string& job, int group_size,
                                  int microbatches, int lookahead, absl::Duration compute,
                                  const std::string& token = "", const shardcoord::TlsFiles& tls = {}) {
  std::vector<std::vector<double>> per_rank(group_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < group_size; ++r) {
    threads.emplace_back([&, r] {
      shardcoord::WorkerOptions o;
      o.coordinator_address = address;
      o.job_id = job;
      o.rank = r;
      o.world_size = group_size;
      o.group_size = group_size;
      o.modules = {{"vision_tower", 1 << 20, {}, false}};
      o.lookahead = std::max(1, lookahead);
      o.token = token;
      o.tls = tls;
      auto w = shardcoord::Worker::Connect(o);
      if (!w.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", r, w.status().ToString().c_str());
        return;
      }
      int reported = 0;
      auto report_until = [&](int k) {
        while (reported <= k && reported < microbatches) {
          (*w)->ReportPlan({{0, reported}, {{"vision_tower", VisionCalls(r, reported)}}}).IgnoreError();
          ++reported;
        }
      };
      for (int k = 0; k < microbatches; ++k) {
        if (lookahead > 0) {
          report_until(k + lookahead - 1);
          const absl::Time t0 = absl::Now();
          auto d = (*w)->GetDecision({0, k}, absl::Seconds(30));
          per_rank[r].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
          if (!d.ok()) break;
        } else {
          const absl::Time t0 = absl::Now();
          report_until(k);
          auto d = (*w)->GetDecision({0, k}, absl::Seconds(30));
          per_rank[r].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
          if (!d.ok()) break;
        }
        Compute(compute);
      }
      (*w)->Close();
    });
  }
  for (auto& t : threads) t.join();
  std::vector<double> all;
  for (auto& v : per_rank) all.insert(all.end(), v.begin(), v.end());
  return all;
}

std::vector<double> RunInbandAllreduce(int group_size, int microbatches, absl::Duration compute) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::vector<double>> per_rank(group_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < group_size; ++r) {
    threads.emplace_back([&, r] {
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(r, group_size);
      ctx->setTimeout(std::chrono::seconds(30));
      ctx->connectFullMesh(*store, device);
      uint32_t mask = 0, out = 0;
      for (int k = 0; k < microbatches; ++k) {
        mask = VisionCalls(r, k) > 0 ? 1u : 0u;
        const absl::Time t0 = absl::Now();
        gloo::AllreduceOptions opts(ctx);
        opts.setInput(&mask, 1);
        opts.setOutput(&out, 1);
        opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<uint32_t>));
        opts.setTimeout(std::chrono::seconds(30));
        gloo::allreduce(opts);
        per_rank[r].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
        Compute(compute);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<double> all;
  for (auto& v : per_rank) all.insert(all.end(), v.begin(), v.end());
  return all;
}

// Writes a CA and a certificate for 127.0.0.1 signed by it into `dir` with the openssl CLI.
bool MakeCertificates(const std::string& dir) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
  const std::string cmd =
      absl::StrCat("cd ", dir, " && openssl req -x509 ", ec, " -keyout ca.key -out ca.pem -days 1 -subj /CN=bench-ca",
                   " && openssl req ", ec, " -keyout server.key -out server.csr -subj /CN=localhost",
                   " && printf 'subjectAltName=IP:127.0.0.1\\n' > ext",
                   " && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem",
                   " -days 1 -extfile ext && chmod 600 server.key");
  return std::system(("(" + cmd + ") >/dev/null 2>&1").c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"critical_path: per-microbatch cost on the trainer's critical path"};
  int group_size = 8, microbatches = 2000, lookahead = 4, compute_us = 1000;
  app.add_option("--group-size", group_size, "ranks in the shard group");
  app.add_option("--microbatches", microbatches, "microbatches per rank");
  app.add_option("--lookahead", lookahead, "plans reported ahead (shardcoord with lookahead)");
  app.add_option("--compute-us", compute_us, "compute (sleep) between microbatches");
  CLI11_PARSE(app, argc, argv);
  shardcoord::logging::SetLevel("warn");
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  shardcoord::coordinator::CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  auto server = shardcoord::coordinator::CoordinatorServer::Start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  // The same coordinator with TLS and tokens (DESIGN 13), to measure what they cost.
  char dir[] = "/tmp/critical-path-XXXXXX";
  const std::string token = "rank-critical-path-0123456789abcdef";
  if (mkdtemp(dir) == nullptr || !MakeCertificates(dir)) {
    std::fprintf(stderr, "cannot make test certificates in /tmp (is openssl installed?)\n");
    return 1;
  }
  const std::string tokens = std::string(dir) + "/tokens";
  if (std::FILE* f = std::fopen(tokens.c_str(), "w"); f != nullptr) {
    std::fprintf(f, "rank %s\n", token.c_str());
    std::fclose(f);
  }
  chmod(tokens.c_str(), 0600);
  o.token_file = tokens;
  o.tls.cert_file = std::string(dir) + "/server.pem";
  o.tls.key_file = std::string(dir) + "/server.key";
  shardcoord::TlsFiles tls;
  tls.ca_file = std::string(dir) + "/ca.pem";
  auto secured = shardcoord::coordinator::CoordinatorServer::Start(o);
  if (!secured.ok()) {
    std::fprintf(stderr, "%s\n", std::string(secured.status().message()).c_str());
    return 1;
  }
  const absl::Duration compute = absl::Microseconds(compute_us);
  Stats ahead = Summarize(RunShardcoord((*server)->address(), "ahead", group_size, microbatches, lookahead, compute));
  Stats none = Summarize(RunShardcoord((*server)->address(), "none", group_size, microbatches, 0, compute));
  Stats ahead_t = Summarize(
      RunShardcoord((*secured)->address(), "ahead", group_size, microbatches, lookahead, compute, token, tls));
  Stats none_t =
      Summarize(RunShardcoord((*secured)->address(), "none", group_size, microbatches, 0, compute, token, tls));
  std::system(("rm -rf " + std::string(dir)).c_str());
  Stats inband = Summarize(RunInbandAllreduce(group_size, microbatches, compute));
  std::printf("| approach (group of %d, %d microbatches, %d us compute) | p50 (us) | p99 (us) | mean (us) |\n",
              group_size, microbatches, compute_us);
  std::printf("|---|---:|---:|---:|\n");
  std::printf("| shardcoord, lookahead %d: GetDecision | %.1f | %.1f | %.1f |\n", lookahead, ahead.p50_us,
              ahead.p99_us, ahead.mean_us);
  std::printf("| shardcoord, no lookahead: ReportPlan + GetDecision | %.1f | %.1f | %.1f |\n", none.p50_us,
              none.p99_us, none.mean_us);
  std::printf("| shardcoord with TLS and tokens, lookahead %d: GetDecision | %.1f | %.1f | %.1f |\n", lookahead,
              ahead_t.p50_us, ahead_t.p99_us, ahead_t.mean_us);
  std::printf("| shardcoord with TLS and tokens, no lookahead: ReportPlan + GetDecision | %.1f | %.1f | %.1f |\n",
              none_t.p50_us, none_t.p99_us, none_t.mean_us);
  std::printf("| baseline: in-band Gloo all-reduce(MAX) of a bitmask | %.1f | %.1f | %.1f |\n", inband.p50_us,
              inband.p99_us, inband.mean_us);
  std::printf("\nratio in-band / shardcoord-with-lookahead (p50): %.0fx\n",
              ahead.p50_us > 0 ? inband.p50_us / ahead.p50_us : 0.0);
  return 0;
}
