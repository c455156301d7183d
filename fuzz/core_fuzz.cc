// libFuzzer target: CoordinatorCore's message handling, as the gRPC adapter drives it, on a
// fake clock. The input is a script of calls from up to 8 sessions: registrations, plans,
// heartbeats, communicator calls, leaves and ticks, built from the input's bytes, plus raw
// protobuf messages parsed from them. Besides crashes, leaks and undefined behaviour
// (ASan/UBSan), it checks the contract itself: every member of a group that receives a
// decision for a microbatch receives the same one (same digest), never two.
//
//   scripts/fuzz.sh core 60      (builds with clang, runs 60 s; see docs/RELIABILITY.md)
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>

#include "coordinator/core/coordinator_core.h"
#include "coordinator/server/wire_intake.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/internal/logging.h"
#include "support/core_fakes.h"

namespace {

using shardcoord::coordinator::CommMembership;
using shardcoord::coordinator::CoordinatorCore;
using shardcoord::coordinator::CoordinatorOptions;
using shardcoord::coordinator::FromWire;
using shardcoord::testing::FakeClock;
using shardcoord::testing::RecordingSink;
namespace v1 = shardcoord::v1;

constexpr int kSessions = 8;

// A worker's traffic after its registration travels in bundles (one part each here; the
// fuzzer's raw bundles mix them).
v1::WorkerBundle Bundle(const v1::PlanBatch& plans) {
  v1::WorkerBundle b;
  *b.mutable_plans() = plans;
  return b;
}
v1::WorkerBundle Bundle(const v1::Heartbeat& heartbeat) {
  v1::WorkerBundle b;
  *b.mutable_heartbeat() = heartbeat;
  return b;
}
v1::WorkerBundle Bundle(const v1::CommAborted& ack) {
  v1::WorkerBundle b;
  *b.add_comm_aborted() = ack;
  return b;
}

// What the inputs reached, printed at exit with SHARDCOORD_FUZZ_STATS=1 (docs/RELIABILITY.md).
struct Reach {
  long registered = 0, decisions = 0, comm_joins_ok = 0;
  ~Reach() {
    if (std::getenv("SHARDCOORD_FUZZ_STATS") != nullptr) {
      std::fprintf(stderr, "reached: %ld registrations, %ld decisions checked, %ld communicator joins\n", registered,
                   decisions, comm_joins_ok);
    }
  }
} reach;
const char* const kJobs[] = {"a", "b", "c\x1b[2J"};
const char* const kModules[] = {"vision_tower", "audio_tower", "tower.\n"};

struct Session {
  std::shared_ptr<RecordingSink> sink;
  std::string job;
  int rank = -1;
  std::string key;  // session_key once registered.
  int64_t epoch = 0;  // Group epoch at registration.
  int64_t next = 0;   // Next microbatch (step * 2 + microbatch) to plan.
  size_t seen = 0;  // Messages of the sink already checked.
};

class Script {
 public:
  explicit Script(FuzzedDataProvider& in) : in_(in), clock_(std::make_shared<FakeClock>()) {
    CoordinatorOptions o;
    o.limits.max_world_size = 16;
    o.limits.max_total_ranks = 32;
    o.limits.max_jobs = 4;
    o.limits.max_pending_microbatches = 64;
    o.limits.max_communicators_per_job = 4;
    o.limits.max_store_value_bytes = 256;
    o.event_capacity = 64;
    core_ = std::make_unique<CoordinatorCore>(o, clock_);
  }

  void Run() {
    while (in_.remaining_bytes() > 0) {
      Step();
      CheckDecisions();
    }
    core_->Shutdown();
    CheckDecisions();
  }

 private:
  std::string Job() { return kJobs[in_.ConsumeIntegralInRange<int>(0, 2)]; }
  std::string Module() { return kModules[in_.ConsumeIntegralInRange<int>(0, 2)]; }
  template <typename M>
  M Raw() {
    M m;
    m.ParseFromString(in_.ConsumeRandomLengthString(512));
    return m;
  }

  // A registration the core accepts unless it clashes with the job's others (most do not).
  v1::RegisterRequest WellFormed() {
    v1::RegisterRequest r;
    r.set_job_id(Job());
    r.set_wire_revision(shardcoord::kWireRevision);
    const int world = 1 << in_.ConsumeIntegralInRange<int>(0, 2);
    r.set_world_size(world);
    r.set_group_size(std::max(1, world >> in_.ConsumeIntegralInRange<int>(0, 1)));
    r.set_rank(in_.ConsumeIntegralInRange<int>(0, world - 1));
    for (const char* name : {"vision_tower", "audio_tower"}) {
      auto* m = r.add_modules();
      m->set_name(name);
      m->set_param_bytes(1 << 20);
      m->add_units()->set_name("layers.0");
    }
    r.set_policy(static_cast<v1::Policy>(in_.ConsumeIntegralInRange<int>(1, 4)));
    r.set_fallback(static_cast<v1::Fallback>(in_.ConsumeIntegralInRange<int>(1, 2)));
    r.set_wrap_outer_model(true);
    r.set_lookahead(4);
    r.set_memory_budget_bytes(in_.ConsumeBool() ? 0 : 8 << 20);
    r.set_host("host");
    return r;
  }

  v1::RegisterRequest Registration(Session& s) {
    if (in_.ConsumeBool()) return WellFormed();
    v1::RegisterRequest r;
    r.set_job_id(Job());
    r.set_wire_revision(shardcoord::kWireRevision);
    r.set_rank(in_.ConsumeIntegralInRange<int>(-1, 8));
    r.set_world_size(in_.ConsumeIntegralInRange<int>(0, 8));
    r.set_group_size(in_.ConsumeIntegralInRange<int>(0, 4));
    const int modules = in_.ConsumeIntegralInRange<int>(0, 2);
    for (int i = 0; i < modules; ++i) {
      auto* m = r.add_modules();
      m->set_name(Module());
      m->set_param_bytes(in_.ConsumeIntegralInRange<int64_t>(-1, 1 << 20));
      if (in_.ConsumeBool()) m->add_units()->set_name("layers.0");
      m->set_outside_inner_root(in_.ConsumeBool());
      m->set_trainable(in_.ConsumeBool());
    }
    r.set_policy(static_cast<v1::Policy>(in_.ConsumeIntegralInRange<int>(0, 5)));
    r.set_fallback(static_cast<v1::Fallback>(in_.ConsumeIntegralInRange<int>(0, 3)));
    r.set_wrap_outer_model(in_.ConsumeBool());
    r.set_lookahead(in_.ConsumeIntegralInRange<int>(-1, 8));
    r.set_memory_budget_bytes(in_.ConsumeIntegralInRange<int64_t>(0, 1 << 22));
    r.set_host("host");
    return r;
  }

  // Mostly the session's next microbatches in order, as a worker sends them.
  v1::PlanBatch Plans(Session& s) {
    v1::PlanBatch b;
    if (in_.ConsumeBool()) {
      const int n = in_.ConsumeIntegralInRange<int>(1, 3);
      for (int i = 0; i < n; ++i) {
        auto* p = b.add_plans();
        p->mutable_key()->set_step(s.next / 2);
        p->mutable_key()->set_microbatch(s.next % 2);
        s.next++;
        (*p->mutable_calls())["vision_tower"] = in_.ConsumeIntegralInRange<int>(0, 1);
        (*p->mutable_calls())["audio_tower"] = in_.ConsumeIntegralInRange<int>(0, 1);
      }
      b.set_epoch(s.epoch);
      return b;
    }
    const int n = in_.ConsumeIntegralInRange<int>(0, 4);
    for (int i = 0; i < n; ++i) {
      auto* p = b.add_plans();
      p->mutable_key()->set_step(in_.ConsumeIntegralInRange<int64_t>(-1, 6));
      p->mutable_key()->set_microbatch(in_.ConsumeIntegralInRange<int>(-1, 3));
      (*p->mutable_calls())[Module()] = in_.ConsumeIntegralInRange<int>(-1, 2);
    }
    b.set_epoch(in_.ConsumeIntegralInRange<int64_t>(0, 3));
    return b;
  }

  void Register(uint64_t id, Session& s, const v1::RegisterRequest& r) {
    if (s.sink) core_->OnSessionClosed(id, "fuzz: new registration on this session");
    s = Session{};
    s.sink = std::make_shared<RecordingSink>();
    s.job = r.job_id();
    s.rank = r.rank();
    s.sink->refuse = in_.ConsumeIntegralInRange<int>(0, 15) == 0;  // A rank that stopped reading.
    if (!core_->Register(id, FromWire(r), s.sink).ok()) return;
    reach.registered++;
    for (const auto& m : s.sink->messages) {
      if (!m.has_registered()) continue;
      s.key = m.registered().session_key();
      s.epoch = m.registered().epoch();
      if (m.registered().has_last_decided()) {
        s.next = m.registered().last_decided().step() * 2 + m.registered().last_decided().microbatch() + 1;
      }
    }
  }

  template <typename Req>
  Req Bound(Req r, const Session& s) {  // A communicator call of the session's own rank, often.
    if (in_.ConsumeBool()) {
      r.set_job_id(s.job);
      r.set_rank(s.rank);
      r.set_session_key(s.key);
      r.set_name(in_.ConsumeBool() ? "world" : in_.ConsumeRandomLengthString(16));
      if constexpr (std::is_same_v<Req, v1::CommJoinRequest>) r.set_timeout_ms(1000);
    }
    return r;
  }

  void Step() {
    const uint64_t id = in_.ConsumeIntegralInRange<uint64_t>(1, kSessions);
    Session& s = sessions_[id];
    switch (in_.ConsumeIntegralInRange<int>(0, 14)) {
      case 0: Register(id, s, Registration(s)); break;
      case 1: Register(id, s, Raw<v1::RegisterRequest>()); break;
      case 2: core_->OnBundle(id, FromWire(Bundle(Plans(s)))); break;
      case 3: core_->OnBundle(id, FromWire(Bundle(Raw<v1::PlanBatch>()))); break;
      case 4: core_->OnBundle(id, FromWire(Bundle(Raw<v1::Heartbeat>()))); break;
      case 5:
        core_->CommJoin(FromWire(Bound(Raw<v1::CommJoinRequest>(), s)), [](absl::StatusOr<CommMembership> r) {
          if (r.ok()) reach.comm_joins_ok++;
        });
        break;
      case 6: (void)core_->StoreSet(FromWire(Bound(Raw<v1::StoreSetRequest>(), s))); break;
      case 7: core_->StoreGet(FromWire(Bound(Raw<v1::StoreGetRequest>(), s)), [](auto) {}); break;
      case 8: (void)core_->CommReport(FromWire(Bound(Raw<v1::CommReportRequest>(), s))); break;
      case 9: core_->OnBundle(id, FromWire(Bundle(Raw<v1::CommAborted>()))); break;
      case 10:
        if (in_.ConsumeBool()) {
          core_->OnGoodbye(id, in_.ConsumeRandomLengthString(64), in_.ConsumeBool());
        } else {
          core_->OnSessionClosed(id, "fuzz: stream ended");
        }
        break;
      case 11:
        clock_->Advance(absl::Milliseconds(in_.ConsumeIntegralInRange<int>(0, 400000)));
        core_->Tick();
        break;
      case 13: {  // A worker's bundle: a structured plan batch, raw heartbeat and acknowledgements.
        v1::WorkerBundle bundle = Raw<v1::WorkerBundle>();
        if (in_.ConsumeBool()) *bundle.mutable_plans() = Plans(s);
        core_->OnBundle(id, FromWire(bundle));
        break;
      }
      case 14: core_->OnBundle(id, FromWire(Raw<v1::WorkerBundle>())); break;
      case 12: {  // What operators see: every query, on every job.
        const std::string job = in_.ConsumeBool() ? Job() : "";
        (void)core_->Status(job);
        (void)core_->Ranks(job);
        (void)core_->Groups(job);
        (void)core_->Decisions(job, in_.ConsumeIntegralInRange<int>(-1, 3), in_.ConsumeIntegralInRange<int>(0, 8));
        (void)core_->Comms(job);
        (void)core_->Events(job, 0, 16);
        break;
      }
    }
  }

  // Every decision a member receives must equal what every other member of its group
  // received for the same microbatch and group epoch.
  void CheckDecisions() {
    for (auto& [id, s] : sessions_) {
      if (!s.sink) continue;
      for (; s.seen < s.sink->messages.size(); ++s.seen) {
        const auto& m = s.sink->messages[s.seen];
        if (!m.has_decisions()) continue;
        for (const auto& d : m.decisions().decisions()) {
          reach.decisions++;
          auto key = std::make_tuple(s.job, d.group(), d.epoch(), d.key().step(), d.key().microbatch());
          auto [it, fresh] = digests_.emplace(key, d.digest());
          if (!fresh && it->second != d.digest()) {
            std::fprintf(stderr, "contract broken: job %s group %d step %ld microbatch %d decided twice, differently\n",
                         s.job.c_str(), d.group(), static_cast<long>(d.key().step()), d.key().microbatch());
            std::abort();
          }
        }
      }
    }
  }

  FuzzedDataProvider& in_;
  std::shared_ptr<FakeClock> clock_;
  std::unique_ptr<CoordinatorCore> core_;
  std::map<uint64_t, Session> sessions_;
  std::map<std::tuple<std::string, int, int64_t, int64_t, int>, uint64_t> digests_;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  shardcoord::logging::SetLevel("off");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Script(in).Run();
  return 0;
}
