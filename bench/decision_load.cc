// decision_load: load generator for the coordinator (a benchmark, not a test).
//
// Simulates N ranks in shard groups of G, each with its own Session stream (gRPC callback
// client reactors spread over a few channels), against an in-process coordinator on
// loopback or a running shardcoordd (--coordinator). Every rank keeps `lookahead` plans in
// flight: each decision it receives releases its next plan, like a trainer's data loader.
//
// Reports, per rank count:
// - throughput: plans accepted and decided per second, after every rank has registered;
// - decision latency per (group, microbatch): from the moment the group's LAST plan for
//   it was handed to gRPC to the moment the LAST member received the decision; p50/p99.
//
//   decision_load --ranks 8,64,512,4096 --group-size 8 --microbatches 200
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/server/coordinator_server.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace {

namespace v1 = shardcoord::v1;

int64_t NowNs() { return absl::GetCurrentTimeNanos(); }

// Counters and timestamps, in memory shared by the generator processes (--procs): every
// process simulates whole groups, so each (group, microbatch) slot has one writer process.
struct Board {
  std::atomic<int> registered{0};
  std::atomic<int> finished{0};
  std::atomic<int> failed{0};
  std::atomic<int64_t> plans_sent{0};
  std::atomic<int64_t> start_ns{0};  // Set once every rank of every process registered.
  std::atomic<int> cancelled{0};     // The run passed its deadline.
};

struct Shared {
  int world = 0;
  int group_size = 0;
  int microbatches = 0;
  int lookahead = 4;
  int batch = 1;        // Plans per message.
  bool paced = false;   // Plans released by the pacing thread, not by decisions.
  double rate = 0;
  int channels = 8;
  std::string job;
  Board* board = nullptr;
  // [group * microbatches + mb]: latest plan send time and latest decision receive time.
  std::atomic<int64_t>* last_send = nullptr;
  std::atomic<int64_t>* last_recv = nullptr;

  void AtomicMax(std::atomic<int64_t>& a, int64_t v) {
    int64_t cur = a.load(std::memory_order_relaxed);
    while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  }
};

// One simulated rank: a Session stream driven by callbacks, never blocking.
class SimRank final : public grpc::ClientBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  SimRank(v1::Coordinator::Stub* stub, Shared* shared, int rank) : shared_(shared), rank_(rank) {
    group_ = rank / shared->group_size;
    stub->async()->Session(&ctx_, this);
    v1::WorkerMessage reg;
    auto* r = reg.mutable_register_();
    r->set_job_id(shared->job);
    r->set_rank(rank);
    r->set_world_size(shared->world);
    r->set_group_size(shared->group_size);
    r->set_policy(v1::POLICY_AUTO);
    r->set_fallback(v1::FALLBACK_ROOT);
    r->set_wrap_outer_model(true);
    r->set_lookahead(shared->lookahead);
    for (const char* name : {"vision_tower", "audio_tower"}) {
      auto* m = r->add_modules();
      m->set_name(name);
      m->set_param_bytes(1 << 20);
    }
    Enqueue(std::move(reg));
    StartRead(&in_);
    StartCall();
  }

  // Called once every rank has registered: the first `lookahead` plans, `batch` per message.
  void Go() {
    if (shared_->paced) return;
    std::lock_guard<std::mutex> lock(plan_mu_);
    while (next_plan_ < shared_->lookahead && next_plan_ < shared_->microbatches) SendPlansLocked();
  }

  // Paced mode: microbatch `mb` is due now; plan it as soon as the window allows.
  void Release(int mb) {
    std::lock_guard<std::mutex> lock(plan_mu_);
    released_ = mb + 1;
    while (next_plan_ < released_ && next_plan_ - received_ < shared_->lookahead) SendPlansLocked();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (in_.has_registered()) {
      shared_->board->registered.fetch_add(1);
    } else if (in_.has_decisions()) {
      const int64_t now = NowNs();
      std::lock_guard<std::mutex> lock(plan_mu_);
      for (const auto& d : in_.decisions().decisions()) {
        const int mb = static_cast<int>(d.step()) * 4 + d.microbatch();
        shared_->AtomicMax(shared_->last_recv[group_ * shared_->microbatches + mb], now);
        ++received_;
      }
      // Refill the window, `batch` plans per message (paced: only what is due).
      const int limit = shared_->paced ? released_ : shared_->microbatches;
      while (next_plan_ < limit && shared_->lookahead - (next_plan_ - received_) >=
                                       (shared_->paced ? 1 : shared_->batch)) {
        SendPlansLocked();
      }
      if (received_ == shared_->microbatches) {
        v1::WorkerMessage bye;
        bye.mutable_goodbye()->set_reason("benchmark done");
        Enqueue(std::move(bye));
      }
    } else if (in_.has_plan_rejected() || in_.has_group_failure() || in_.has_microbatch_failed()) {
      if (shared_->board->failed.fetch_add(1) == 0) {
        std::fprintf(stderr, "rank %d: %s\n", rank_, in_.ShortDebugString().c_str());
      }
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) return;
    StartNextWriteLocked();
  }

  void OnDone(const grpc::Status& s) override {
    if (received_ != shared_->microbatches) shared_->board->failed.fetch_add(1);
    shared_->board->finished.fetch_add(1);
  }

 private:
  // Sends up to `batch` plans (paced: only released ones) in one message.
  void SendPlansLocked() {
    v1::WorkerMessage m;
    const int first = next_plan_;
    const int limit = shared_->paced ? released_ : shared_->microbatches;
    while (next_plan_ < limit && next_plan_ - first < shared_->batch &&
           next_plan_ - received_ < shared_->lookahead) {
      const int mb = next_plan_++;
      auto* p = m.mutable_bundle()->mutable_plans()->add_plans();
      p->set_step(mb / 4);
      p->set_microbatch(mb % 4);
      // Divergent now and then, so every decision path is exercised.
      const int vision = (mb % 5 == 0) ? (rank_ % 2) : (mb % 2);
      (*p->mutable_calls())["vision_tower"] = vision;
      (*p->mutable_calls())["audio_tower"] = 0;
    }
    const int n = next_plan_ - first;
    if (n == 0) return;
    shared_->board->plans_sent.fetch_add(n, std::memory_order_relaxed);
    Enqueue(std::move(m), group_ * shared_->microbatches + first, n);
  }

  // `slot` >= 0: record the send time of slots [slot, slot + n) when the write starts.
  void Enqueue(v1::WorkerMessage m, int slot = -1, int n = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    const bool goodbye = m.has_goodbye();
    queue_.push_back({std::move(m), slot, n, goodbye});
    StartNextWriteLocked();
  }

  void StartNextWriteLocked() {
    if (writing_ || queue_.empty()) return;
    Pending p = std::move(queue_.front());
    queue_.pop_front();
    // Coalesce queued plans into one message, as the worker library does.
    const int64_t now = NowNs();
    while (p.msg.has_bundle() && !queue_.empty() && queue_.front().msg.has_bundle()) {
      for (const auto& plan : queue_.front().msg.bundle().plans().plans()) {
        *p.msg.mutable_bundle()->mutable_plans()->add_plans() = plan;
      }
      for (int i = 0; i < queue_.front().n; ++i) shared_->AtomicMax(shared_->last_send[queue_.front().slot + i], now);
      queue_.pop_front();
    }
    for (int i = 0; i < p.n; ++i) shared_->AtomicMax(shared_->last_send[p.slot + i], now);
    current_ = std::move(p.msg);
    writing_ = true;
    if (p.last) {
      StartWriteLast(&current_, grpc::WriteOptions());
    } else {
      StartWrite(&current_);
    }
  }

  struct Pending {
    v1::WorkerMessage msg;
    int slot;
    int n;
    bool last;
  };

  Shared* const shared_;
  const int rank_;
  int group_ = 0;
  grpc::ClientContext ctx_;
  v1::CoordinatorMessage in_;
  std::mutex mu_;
  std::deque<Pending> queue_;
  bool writing_ = false;
  v1::WorkerMessage current_;
  std::mutex plan_mu_;  // Guards the plan window below (read callbacks and the pacer).
  int next_plan_ = 0;
  int received_ = 0;
  int released_ = 0;
};

struct Result {
  int ranks;
  int64_t plans;
  double seconds;
  double plans_per_s;
  double p50_us, p99_us, max_us;
  int failed;
  // Paced mode: a trainer that plans `lookahead` microbatches ahead runs microbatch t at
  // start + (t + lookahead) / rate. A (group, microbatch) whose decision reached its last
  // member after that moment stalled the critical path.
  int64_t stalled = -1;
  double stall_p99_us = 0;
};

// Simulates the ranks of every group g with g % parts == part, from registration to the
// end of the run: in this process (--procs 1) or in a forked one.
// Several coordinators (a comma-separated `address`): group g talks to coordinator g % K, as
// a giant job partitioned over K daemons would (DESIGN 7).
void Simulate(const std::string& address, Shared& shared, int part, int parts, absl::Time deadline) {
  const std::vector<std::string> addresses = absl::StrSplit(address, ',');
  const int k = static_cast<int>(addresses.size());
  // [coordinator][channel]
  std::vector<std::vector<std::unique_ptr<v1::Coordinator::Stub>>> stubs(k);
  for (int a = 0; a < k; ++a) {
    for (int c = 0; c < std::max(1, shared.channels / k); ++c) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // A separate connection per channel.
      args.SetInt("shardcoord.bench.channel", c);
      stubs[a].push_back(v1::Coordinator::NewStub(
          grpc::CreateCustomChannel(addresses[a], grpc::InsecureChannelCredentials(), args)));
    }
  }
  std::vector<std::unique_ptr<SimRank>> ranks;
  for (int r = 0; r < shared.world; ++r) {
    const int group = r / shared.group_size;
    if (group % parts != part) continue;
    auto& mine = stubs[group % k];
    ranks.push_back(std::make_unique<SimRank>(mine[ranks.size() % mine.size()].get(), &shared, r));
  }
  Board& board = *shared.board;
  while (board.start_ns.load() == 0 && !board.cancelled.load() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const absl::Time start = absl::FromUnixNanos(board.start_ns.load());
  absl::SleepFor(start - absl::Now());
  for (auto& r : ranks) r->Go();
  if (shared.paced) {
    // Microbatch t of every rank becomes due at start + t / rate.
    for (int t = 0; t < shared.microbatches && absl::Now() < deadline; ++t) {
      absl::SleepFor(start + absl::Seconds(t / shared.rate) - absl::Now());
      for (auto& r : ranks) r->Release(t);
    }
  }
  while (board.finished.load() < shared.world && !board.cancelled.load() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  if (board.finished.load() < shared.world) {
    // Reactors are owned here: leak them rather than destroy them under live callbacks.
    for (auto& r : ranks) r.release();
  }
}

Result RunOnce(const std::string& address, int world, int group_size, int microbatches, int lookahead,
               int batch, double rate, int channels, int procs, absl::Duration deadline) {
  Shared shared;
  shared.world = world;
  shared.group_size = group_size;
  shared.microbatches = microbatches;
  shared.lookahead = lookahead;
  shared.batch = batch;
  shared.paced = rate > 0;
  shared.rate = rate;
  shared.channels = std::max(1, channels / procs);
  shared.job = absl::StrCat("load-", world, "-", NowNs());
  const int groups = world / group_size;
  const size_t slots = static_cast<size_t>(groups) * microbatches;
  const size_t bytes = sizeof(Board) + 2 * slots * sizeof(std::atomic<int64_t>);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  shared.board = new (mem) Board();
  shared.last_send = new (static_cast<char*>(mem) + sizeof(Board)) std::atomic<int64_t>[slots];
  shared.last_recv = shared.last_send + slots;
  for (size_t i = 0; i < slots; ++i) {
    shared.last_send[i] = 0;
    shared.last_recv[i] = 0;
  }
  Board& board = *shared.board;
  const absl::Time run_deadline = absl::Now() + deadline;
  std::vector<pid_t> children;
  std::thread local;
  if (procs == 1) {
    local = std::thread([&] { Simulate(address, shared, 0, 1, run_deadline); });
  } else {
    std::fflush(stdout);
    for (int i = 0; i < procs; ++i) {
      const pid_t pid = fork();
      if (pid == 0) {
        Simulate(address, shared, i, procs, run_deadline);
        std::fflush(stdout);
        _exit(0);
      }
      if (pid < 0) {
        std::perror("fork");
        std::exit(1);
      }
      children.push_back(pid);
    }
  }
  while (board.registered.load() < world && absl::Now() < run_deadline) absl::SleepFor(absl::Milliseconds(5));
  if (board.registered.load() < world) {
    std::fprintf(stderr, "only %d of %d ranks registered in time\n", board.registered.load(), world);
  }
  const absl::Time start = absl::Now() + absl::Milliseconds(20);
  board.start_ns.store(absl::ToUnixNanos(start));
  while (board.finished.load() < world && absl::Now() < run_deadline) absl::SleepFor(absl::Milliseconds(2));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (board.finished.load() < world) {
    std::fprintf(stderr, "deadline: %d of %d ranks finished; cancelling\n", board.finished.load(), world);
    board.cancelled.store(1);
  }
  if (local.joinable()) local.join();
  for (pid_t pid : children) waitpid(pid, nullptr, 0);

  std::vector<double> lat;
  lat.reserve(groups * microbatches);
  for (int i = 0; i < groups * microbatches; ++i) {
    if (shared.last_recv[i] > 0 && shared.last_send[i] > 0) {
      lat.push_back((shared.last_recv[i] - shared.last_send[i]) / 1000.0);
    }
  }
  std::sort(lat.begin(), lat.end());
  auto pct = [](const std::vector<double>& v, double p) {
    return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
  };
  const int64_t plans = board.plans_sent.load();
  Result result{world, plans, seconds, plans / seconds, pct(lat, 0.50), pct(lat, 0.99),
                lat.empty() ? 0 : lat.back(), board.failed.load()};
  if (shared.paced) {
    const int64_t start_ns = absl::ToUnixNanos(start);
    std::vector<double> stalls;
    for (int g = 0; g < groups; ++g) {
      for (int mb = 0; mb < microbatches; ++mb) {
        const int64_t due = start_ns + static_cast<int64_t>((mb + lookahead) / rate * 1e9);
        const int64_t recv = shared.last_recv[g * microbatches + mb];
        stalls.push_back(recv > due ? (recv - due) / 1000.0 : 0.0);
      }
    }
    std::sort(stalls.begin(), stalls.end());
    result.stalled = std::count_if(stalls.begin(), stalls.end(), [](double v) { return v > 0; });
    result.stall_p99_us = pct(stalls, 0.99);
  }
  munmap(mem, bytes);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decision_load: coordinator throughput and decision latency under simulated ranks"};
  std::string ranks_arg = "8,64,512,4096";
  std::string coordinator;
  int group_size = 8, microbatches = 200, lookahead = 4, batch = 1, channels = 8, deadline_s = 300, procs = 1;
  double rate = 0;
  app.add_option("--ranks", ranks_arg, "comma-separated rank counts");
  app.add_option("--group-size", group_size, "shard group size");
  app.add_option("--microbatches", microbatches, "microbatches each rank plans");
  app.add_option("--lookahead", lookahead, "plans in flight per rank");
  app.add_option("--batch", batch, "plans per message (a data loader that prefetches several)");
  app.add_option("--rate", rate, "microbatches per second per rank (0: as fast as decisions allow)");
  app.add_option("--channels", channels, "client connections the ranks share");
  app.add_option("--coordinator", coordinator,
                 "use a running shardcoordd at HOST:PORT (default: in-process); several, comma-separated: group g "
                 "talks to the (g mod K)-th");
  app.add_option("--deadline-s", deadline_s, "give up on a run after this long");
  app.add_option("--procs", procs,
                 "generator processes, each simulating a share of the groups over its share of --channels "
                 "(needs --coordinator)")
      ->check(CLI::Range(1, 256));
  CLI11_PARSE(app, argc, argv);
  shardcoord::logging::SetLevel("warn");
  // Abseil's debug deadlock detector costs a graph update per lock; the daemon turns it off too.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (procs > 1 && coordinator.empty()) {
    std::fprintf(stderr, "--procs > 1 needs --coordinator (a daemon of its own, not one in this process)\n");
    return 2;
  }
  if (batch < 1 || batch > lookahead) {
    std::fprintf(stderr, "--batch must be in 1..--lookahead\n");
    return 2;
  }

  std::unique_ptr<shardcoord::coordinator::CoordinatorServer> server;
  std::string address = coordinator;
  if (address.empty()) {
    shardcoord::coordinator::CoordinatorOptions o;
    o.listen_address = "127.0.0.1:0";
    o.heartbeat_timeout = absl::Seconds(120);  // Simulated ranks plan constantly; no heartbeats.
    o.decision_history = 16;
    auto s = shardcoord::coordinator::CoordinatorServer::Start(o);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.status().message()).c_str());
      return 1;
    }
    server = std::move(*s);
    address = server->address();
  }
  if (rate > 0) {
    std::printf("| ranks | groups | plans | seconds | plans/s | p50 latency (us) | p99 latency (us) | max (us) | failures | stalled decisions | p99 stall (us) |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  } else {
    std::printf("| ranks | groups | plans | seconds | plans/s | p50 latency (us) | p99 latency (us) | max (us) | failures |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  int rc = 0;
  for (absl::string_view part : absl::StrSplit(ranks_arg, ',')) {
    int world = 0;
    if (!absl::SimpleAtoi(part, &world) || world <= 0 || world % group_size != 0) {
      std::fprintf(stderr, "--ranks entry '%s' must be a positive multiple of the group size\n",
                   std::string(part).c_str());
      return 2;
    }
    Result r = RunOnce(address, world, group_size, microbatches, lookahead, batch, rate, std::min(channels, world),
                       procs,
                       absl::Seconds(deadline_s));
    std::printf("| %d | %d | %lld | %.2f | %.0f | %.0f | %.0f | %.0f | %d |", r.ranks, r.ranks / group_size,
                static_cast<long long>(r.plans), r.seconds, r.plans_per_s, r.p50_us, r.p99_us, r.max_us,
                r.failed);
    if (r.stalled >= 0) {
      std::printf(" %lld of %lld | %.0f |", static_cast<long long>(r.stalled),
                  static_cast<long long>(r.ranks / group_size) * microbatches, r.stall_p99_us);
    }
    std::printf("\n");
    std::fflush(stdout);
    if (r.failed) rc = 1;
  }
  return rc;
}
