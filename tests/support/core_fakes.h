// Fakes for unit tests of CoordinatorCore: a clock the test moves, a sink that records
// what the core sends to one rank (or refuses, as a rank that stopped reading), and the
// harness the core's test fixtures share (a core on the fake clock, a sink per rank).
#ifndef SHARDCOORD_TESTS_SUPPORT_CORE_FAKES_H_
#define SHARDCOORD_TESTS_SUPPORT_CORE_FAKES_H_

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/core/clock.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/invariant.h"
#include "coordinator/server/wire_intake.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::testing {

using coordinator::Clock;
using coordinator::RankSink;

class FakeClock final : public Clock {
 public:
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'700'000'000);
};

// Records what the core sends to one rank.
class RecordingSink final : public RankSink {
 public:
  absl::Status Send(v1::CoordinatorMessage msg) override {
    if (refuse) return absl::ResourceExhaustedError("not reading its session stream (test sink refuses)");
    messages.push_back(msg);
    return absl::OkStatus();
  }
  // Kept as the message it stands for (the daemon's sink writes those bytes).
  absl::Status SendDecisions(std::vector<coordinator::EncodedDecision> batch) override {
    absl::StatusOr<v1::CoordinatorMessage> msg = coordinator::DecodeDecisions(batch);
    if (!msg.ok()) {  // A bug in the encoding: stop here (the core fuzzer links this without gtest).
      std::fprintf(stderr, "%s\n", msg.status().ToString().c_str());
      std::abort();
    }
    return Send(*std::move(msg));
  }
  bool refuse = false;  // Acts as a rank that stopped reading: its queue is full.
  void Close(const absl::Status& status) override {
    closed = true;
    close_status = status;
  }
  // What the budget sees of the rank's queue (set by a test), and whether it was cut for it.
  Backlog backlog() const override { return backlog_; }
  void CutForNotReading() override { cut = true; }
  Backlog backlog_;
  bool cut = false;

  std::vector<v1::MicrobatchDecision> Decisions() const {
    std::vector<v1::MicrobatchDecision> out;
    for (const auto& m : messages) {
      if (m.has_decisions()) out.insert(out.end(), m.decisions().decisions().begin(), m.decisions().decisions().end());
    }
    return out;
  }
  template <typename Pred>
  std::vector<v1::CoordinatorMessage> Where(Pred pred) const {
    std::vector<v1::CoordinatorMessage> out;
    for (const auto& m : messages) {
      if (pred(m)) out.push_back(m);
    }
    return out;
  }
  std::vector<v1::PlanRejected> Rejections() const {
    std::vector<v1::PlanRejected> out;
    for (const auto& m : messages) {
      if (m.has_plan_rejected()) out.push_back(m.plan_rejected());
    }
    return out;
  }

  std::vector<v1::CoordinatorMessage> messages;
  bool closed = false;
  absl::Status close_status;
};

// A CoordinatorCore on a FakeClock; each registered rank gets a RecordingSink and a session.
class CoreHarness {
 public:
  explicit CoreHarness(coordinator::CoordinatorOptions options)
      : options_(std::move(options)),
        clock_(std::make_shared<FakeClock>()),
        core_(std::make_unique<coordinator::CoordinatorCore>(options_, clock_)) {}
  // Every test of the core also checks that none of its invariants failed (invariant.h).
  virtual ~CoreHarness() {
    EXPECT_EQ(coordinator::InvariantFailures(), invariants_failed_before_)
        << "the core reported an internal error (see the log above)";
  }

  // A new core with `options` (same clock); ranks must register again.
  void Reset(const coordinator::CoordinatorOptions& options) {
    options_ = options;
    core_ = std::make_unique<coordinator::CoordinatorCore>(options_, clock_);
    sinks_.clear();
    sessions_.clear();
  }

  // What a worker sends after registering, as it sends it (in a bundle), through the
  // transport's conversion.
  void OnPlans(uint64_t session, const v1::PlanBatch& batch) {
    v1::WorkerBundle bundle;
    *bundle.mutable_plans() = batch;
    core_->OnBundle(session, coordinator::FromWire(bundle));
  }
  void OnHeartbeat(uint64_t session, const v1::Heartbeat& heartbeat = {}) {
    v1::WorkerBundle bundle;
    *bundle.mutable_heartbeat() = heartbeat;
    core_->OnBundle(session, coordinator::FromWire(bundle));
  }
  void OnCommAborted(uint64_t session, const v1::CommAborted& ack) {
    v1::WorkerBundle bundle;
    *bundle.add_comm_aborted() = ack;
    core_->OnBundle(session, coordinator::FromWire(bundle));
  }

  // Registers `r.rank()` on a new session with a new sink; kept only when accepted.
  absl::Status Register(const v1::RegisterRequest& r) {
    auto sink = std::make_shared<RecordingSink>();
    absl::Status s = core_->Register(next_session_, coordinator::FromWire(r), sink);
    if (s.ok()) {
      sinks_[r.rank()] = sink;
      sessions_[r.rank()] = next_session_;
    }
    next_session_++;
    return s;
  }

 protected:
  coordinator::CoordinatorOptions options_;
  std::shared_ptr<FakeClock> clock_;
  std::unique_ptr<coordinator::CoordinatorCore> core_;
  std::map<int, std::shared_ptr<RecordingSink>> sinks_;
  std::map<int, uint64_t> sessions_;
  const int64_t invariants_failed_before_ = coordinator::InvariantFailures();
  uint64_t next_session_ = 1;
};

}  // namespace shardcoord::testing

#endif  // SHARDCOORD_TESTS_SUPPORT_CORE_FAKES_H_
