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
// --comms world|group: each rank, once registered, also opens a communicator ("world": every
// rank of the job; "group": its shard group's, "group/<g>") as a trainer does (CommJoin with
// the session key, then CommReport KIND_READY; no store rendezvous: there is no transport to
// connect), and from the start of the run sends a heartbeat every heartbeat interval (the
// coordinator's, or --heartbeat-ms) carrying the communicator's progress (CommProgress: two
// collectives issued and completed per decided microbatch, so increasing), in the same
// bundle as any plans it has queued. The joins are bounded (--comm-timeout-s); a rank whose
// join or report fails counts as a failure. Heartbeats without communicators: --heartbeat-ms.
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
#include "shardcoord/proto/convert.h"
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
  // --comms: ranks whose communicator is ready (joined and reported), or failed to be.
  std::atomic<int> comm_ready{0};
  std::atomic<int> comm_failed{0};
  std::atomic<int64_t> comm_epoch{0};      // The epoch a rank joined (the highest).
  std::atomic<int> heartbeat_interval_ms{0};  // As the coordinator told the first rank.
  std::atomic<int64_t> heartbeats{0};      // Heartbeats queued (with progress under --comms).
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
  std::string comms;     // "", "world" or "group".
  int comm_timeout_s = 120;
  int heartbeat_ms = 0;  // 0: the coordinator's interval (with --comms), else no heartbeats.
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
  SimRank(v1::Coordinator::Stub* stub, Shared* shared, int rank, std::atomic<int>* unary_in_flight)
      : shared_(shared), rank_(rank), stub_(stub), unary_in_flight_(unary_in_flight) {
    group_ = rank / shared->group_size;
    stub->async()->Session(&ctx_, this);
    v1::WorkerMessage reg;
    auto* r = reg.mutable_register_();
    r->set_job_id(shared->job);
    r->set_wire_revision(shardcoord::kWireRevision);
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
      int expected = 0;
      shared_->board->heartbeat_interval_ms.compare_exchange_strong(expected, in_.registered().heartbeat_interval_ms());
      session_key_ = in_.registered().session_key();
      shared_->board->registered.fetch_add(1);
      if (!shared_->comms.empty()) JoinComm();
    } else if (in_.has_decisions()) {
      const int64_t now = NowNs();
      std::lock_guard<std::mutex> lock(plan_mu_);
      for (const auto& d : in_.decisions().decisions()) {
        const int mb = static_cast<int>(d.key().step()) * 4 + d.key().microbatch();
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
    if (!ok) {
      closed_ = true;
      return;
    }
    StartNextWriteLocked();
  }

  void OnDone(const grpc::Status& s) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    if (received_ != shared_->microbatches) shared_->board->failed.fetch_add(1);
    shared_->board->finished.fetch_add(1);
  }

  // A heartbeat, with the communicator's progress once it is ready, queued like a plan (and
  // so written in the same bundle as any plans queued with it).
  void Heartbeat() {
    v1::WorkerMessage m;
    auto* hb = m.mutable_bundle()->mutable_heartbeat();
    hb->set_sent_unix_ms(absl::ToUnixMillis(absl::Now()));
    if (comm_ready_.load(std::memory_order_acquire)) {
      int64_t decided;
      {
        std::lock_guard<std::mutex> lock(plan_mu_);
        decided = received_;
      }
      auto* p = hb->add_comms();
      p->set_name(comm_name_);
      p->set_epoch(comm_epoch_);
      p->set_issued(2 * decided);
      p->set_completed(2 * decided);
    }
    if (Enqueue(std::move(m))) shared_->board->heartbeats.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // --comms: CommJoin, then CommReport KIND_READY; each a callback call with a deadline.
  void JoinComm() {
    comm_name_ = shared_->comms == "world" ? "world" : absl::StrCat("group/", group_);
    join_req_.set_job_id(shared_->job);
    join_req_.set_rank(rank_);
    join_req_.set_name(comm_name_);
    join_req_.set_timeout_ms(shared_->comm_timeout_s * 1000);
    join_req_.set_session_key(session_key_);
    join_ctx_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(shared_->comm_timeout_s + 5)));
    unary_in_flight_->fetch_add(1);
    stub_->async()->CommJoin(&join_ctx_, &join_req_, &join_resp_, [this](grpc::Status s) {
      if (!s.ok()) {
        CommFailed("CommJoin", s);
      } else {
        comm_epoch_ = join_resp_.epoch();
        report_req_.set_job_id(shared_->job);
        report_req_.set_rank(rank_);
        report_req_.set_name(comm_name_);
        report_req_.set_epoch(comm_epoch_);
        report_req_.set_kind(v1::CommReportRequest::KIND_READY);
        report_req_.set_session_key(session_key_);
        report_ctx_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
        unary_in_flight_->fetch_add(1);
        stub_->async()->CommReport(&report_ctx_, &report_req_, &report_resp_, [this](grpc::Status s) {
          if (!s.ok()) {
            CommFailed("CommReport", s);
          } else {
            int64_t seen = shared_->board->comm_epoch.load();
            while (seen < comm_epoch_ && !shared_->board->comm_epoch.compare_exchange_weak(seen, comm_epoch_)) {
            }
            comm_ready_.store(true, std::memory_order_release);
            shared_->board->comm_ready.fetch_add(1);
          }
          unary_in_flight_->fetch_sub(1);
        });
      }
      unary_in_flight_->fetch_sub(1);
    });
  }

  void CommFailed(const char* what, const grpc::Status& s) {
    shared_->board->comm_failed.fetch_add(1);
    if (shared_->board->failed.fetch_add(1) == 0) {
      std::fprintf(stderr, "rank %d: %s %s: %s\n", rank_, what, comm_name_.c_str(), s.error_message().c_str());
    }
  }

  // Sends up to `batch` plans (paced: only released ones) in one message.
  void SendPlansLocked() {
    v1::WorkerMessage m;
    const int first = next_plan_;
    const int limit = shared_->paced ? released_ : shared_->microbatches;
    while (next_plan_ < limit && next_plan_ - first < shared_->batch &&
           next_plan_ - received_ < shared_->lookahead) {
      const int mb = next_plan_++;
      auto* p = m.mutable_bundle()->mutable_plans()->add_plans();
      p->mutable_key()->set_step(mb / 4);
      p->mutable_key()->set_microbatch(mb % 4);
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
  // False once the stream is closed for writes (after the goodbye, or a failed write).
  bool Enqueue(v1::WorkerMessage m, int slot = -1, int n = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    const bool goodbye = m.has_goodbye();
    queue_.push_back({std::move(m), slot, n, goodbye});
    if (goodbye) closed_ = true;
    StartNextWriteLocked();
    return true;
  }

  void StartNextWriteLocked() {
    if (writing_ || queue_.empty()) return;
    Pending p = std::move(queue_.front());
    queue_.pop_front();
    // Coalesce queued plans (and the latest heartbeat) into one bundle, as the worker
    // library does.
    const int64_t now = NowNs();
    while (p.msg.has_bundle() && !queue_.empty() && queue_.front().msg.has_bundle()) {
      const v1::WorkerBundle& next = queue_.front().msg.bundle();
      for (const auto& plan : next.plans().plans()) {
        *p.msg.mutable_bundle()->mutable_plans()->add_plans() = plan;
      }
      if (next.has_heartbeat()) *p.msg.mutable_bundle()->mutable_heartbeat() = next.heartbeat();
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
  v1::Coordinator::Stub* const stub_;
  std::atomic<int>* const unary_in_flight_;  // The process's CommJoin/CommReport calls.
  int group_ = 0;
  grpc::ClientContext ctx_;
  v1::CoordinatorMessage in_;
  std::string session_key_;
  // --comms (written before comm_ready_ is set).
  std::string comm_name_;
  int64_t comm_epoch_ = 0;
  std::atomic<bool> comm_ready_{false};
  grpc::ClientContext join_ctx_, report_ctx_;
  v1::CommJoinRequest join_req_;
  v1::CommJoinResponse join_resp_;
  v1::CommReportRequest report_req_;
  v1::CommReportResponse report_resp_;
  std::mutex mu_;
  std::deque<Pending> queue_;
  bool writing_ = false;
  bool closed_ = false;  // No more writes: goodbye queued, a write failed or the stream ended.
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
  std::atomic<int> unary_in_flight{0};
  std::vector<std::unique_ptr<SimRank>> ranks;
  for (int r = 0; r < shared.world; ++r) {
    const int group = r / shared.group_size;
    if (group % parts != part) continue;
    auto& mine = stubs[group % k];
    ranks.push_back(std::make_unique<SimRank>(mine[ranks.size() % mine.size()].get(), &shared, r, &unary_in_flight));
  }
  Board& board = *shared.board;
  while (board.start_ns.load() == 0 && !board.cancelled.load() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const absl::Time start = absl::FromUnixNanos(board.start_ns.load());
  absl::SleepFor(start - absl::Now());
  // Heartbeats: every interval, each rank once, spread over the interval in 10 ms slices (trainers
  // are not in step), until this process's ranks are done.
  std::atomic<bool> ranks_done{false};
  std::thread heartbeats;
  const int interval_ms =
      shared.heartbeat_ms > 0 ? shared.heartbeat_ms : (shared.comms.empty() ? 0 : board.heartbeat_interval_ms.load());
  if (interval_ms > 0 && !board.cancelled.load()) {
    heartbeats = std::thread([&] {
      const int slices = std::max(1, interval_ms / 10);
      for (int64_t tick = 0; !ranks_done.load() && !board.cancelled.load() && absl::Now() < deadline; ++tick) {
        for (size_t i = tick % slices; i < ranks.size(); i += slices) ranks[i]->Heartbeat();
        absl::SleepFor(start + absl::Milliseconds(10 * (tick + 1)) - absl::Now());
      }
    });
  }
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
  ranks_done.store(true);
  if (heartbeats.joinable()) heartbeats.join();
  // Communicator calls still in flight (a run that never started) hold their reactors too.
  const absl::Time calls_deadline = std::min(deadline, absl::Now() + absl::Seconds(5));
  while (unary_in_flight.load() > 0 && absl::Now() < calls_deadline) absl::SleepFor(absl::Milliseconds(2));
  if (board.finished.load() < shared.world || unary_in_flight.load() > 0) {
    // Reactors are owned here: leak them rather than destroy them under live callbacks.
    for (auto& r : ranks) r.release();
  }
}

Result RunOnce(const std::string& address, int world, int group_size, int microbatches, int lookahead,
               int batch, double rate, int channels, int procs, absl::Duration deadline, const std::string& comms,
               int comm_timeout_s, int heartbeat_ms) {
  Shared shared;
  shared.comms = comms;
  shared.comm_timeout_s = comm_timeout_s;
  shared.heartbeat_ms = heartbeat_ms;
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
  if (!comms.empty()) {
    // Every rank's communicator ready (or failed) before the run starts: each join waits for
    // every member to be live, then each rank reports it connected.
    const absl::Time registered = absl::Now();
    while (board.comm_ready.load() + board.comm_failed.load() < world && absl::Now() < run_deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    std::fprintf(stderr, "comms %s: %d of %d ranks ready (epoch %lld), %d failed, %.2f s after the last registration\n",
                 comms.c_str(), board.comm_ready.load(), world, static_cast<long long>(board.comm_epoch.load()),
                 board.comm_failed.load(), absl::ToDoubleSeconds(absl::Now() - registered));
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
  if (board.heartbeats.load() > 0) {
    std::fprintf(stderr, "heartbeats: %lld queued (%s), every %d ms per rank\n",
                 static_cast<long long>(board.heartbeats.load()),
                 comms.empty() ? "no communicator" : "with the communicator's progress once ready",
                 heartbeat_ms > 0 ? heartbeat_ms : board.heartbeat_interval_ms.load());
  }

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
  std::string comms;
  int comm_timeout_s = 120, heartbeat_ms = 0;
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
  app.add_option("--comms", comms,
                 "each rank opens a communicator once registered (world: every rank's; group: its shard group's) "
                 "and heartbeats carry its progress")
      ->check(CLI::IsMember({"world", "group"}));
  app.add_option("--comm-timeout-s", comm_timeout_s, "how long a rank's CommJoin may wait for every member")
      ->check(CLI::Range(1, 1800));
  app.add_option("--heartbeat-ms", heartbeat_ms,
                 "heartbeat interval (0: the coordinator's with --comms, no heartbeats without)")
      ->check(CLI::Range(0, 60000));
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
                       procs, absl::Seconds(deadline_s), comms, comm_timeout_s, heartbeat_ms);
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
