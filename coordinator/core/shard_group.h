// ShardGroup: one shard group's state (its members, epoch, manifest, decision engine,
// pending microbatches, history and counts) and the rules that touch nothing else. Like
// DecisionEngine it is not thread-safe: the core keeps each group in a GroupSlot, whose mutex
// guards it (ABSL_GUARDED_BY), so that the clang build's lock analysis refuses code that
// touches a group without holding that mutex (DESIGN 9). The core's exclusive lock stands in
// for every group's mutex (CoordinatorCore::Owned); nothing else does.
#ifndef SHARDCOORD_COORDINATOR_CORE_SHARD_GROUP_H_
#define SHARDCOORD_COORDINATOR_CORE_SHARD_GROUP_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/core/buffer_budget.h"
#include "coordinator/core/decision_engine.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

class RankSink;

// A running total of a number a rank reports cumulatively (decision stalls, bytes gathered):
// a report below the previous one is a new worker process counting from zero again, so the
// total never goes down (a Prometheus counter must not) and saturates instead of overflowing
// on a hostile report.
class ReportedTotal {
 public:
  void Take(int64_t reported) {
    if (reported < 0) return;
    const int64_t delta = reported >= last_ ? reported - last_ : reported;
    total_ = delta > INT64_MAX - total_ ? INT64_MAX : total_ + delta;
    last_ = reported;
  }
  int64_t total() const { return total_; }

 private:
  int64_t last_ = 0;
  int64_t total_ = 0;
};

// One rank of a group, as the coordinator knows it.
struct Member {
  int rank = 0;
  int group = 0;
  v1::RankState state = v1::RANK_STATE_UNREGISTERED;
  uint64_t session = 0;
  std::shared_ptr<RankSink> sink;
  std::string host;
  int64_t pid = 0;
  absl::Time last_seen = absl::InfinitePast();
  std::optional<MicrobatchKey> last_planned;
  int64_t plans_received = 0;
  int64_t plans_rejected = 0;
  std::string dead_reason;
  int64_t registrations = 0;
  int lookahead = kDefaultLookahead;
  int64_t memory_budget = 0;
  // Why the rank is to be failed at the next tick ("" while it is not): its sink refused a
  // send (it does not read), or it broke the protocol. Nothing more is sent to it.
  std::string cut_reason;
  std::vector<v1::ModuleMemory> memory;  // As last reported.
  // As last reported, per manifest module (empty: none yet): forward and the sum of its
  // units' gathers, no names (a 16k-rank group holds two numbers per rank and module).
  std::vector<ModuleCostModel> costs;
  int64_t frozen_budget = 0;                               // Measured by the rank; 0: not reported.
  absl::Time costs_taken = absl::InfinitePast();           // When its last report was taken.
  ReportedTotal decision_stalls, decision_stall_us;  // From heartbeats, across worker restarts.
  std::map<std::string, ReportedTotal> gathered_bytes;  // By module of the manifest, likewise.
  std::string session_key;  // Of the live session (RegisterResponse.session_key).
  // What the rank held when it resumed after a restart, until its group recovered;
  // its memory is charged to the daemon's buffers meanwhile.
  std::optional<v1::ResumeState> resume;
  BufferCharge resume_charge;
  v1::CoordinatorMessage outgoing;  // Decisions batched during one call (CoordinatorCore::Flush).

  bool live() const { return state == v1::RANK_STATE_LIVE; }
  // Whether the rank can no longer report `key`: it planned past it, or it left before it.
  bool WillNeverReport(const MicrobatchKey& key) const {
    if (state == v1::RANK_STATE_LEFT) return !last_planned || *last_planned < key;
    return last_planned && key < *last_planned;
  }
};

// A microbatch some members reported and the group has not resolved yet.
struct PendingMicrobatch {
  std::vector<std::vector<int32_t>> calls;  // [module][member index]
  std::vector<bool> reported;               // [member index]
  int num_reported = 0;
  absl::Time first_report;
  // Static policies: the decision, made when the first rank reported the key and given to
  // each rank as it reports; the entry lives on until every rank reported it.
  std::optional<v1::MicrobatchDecision> decided;
};

class ShardGroup {
 public:
  using PlanCalls = std::vector<std::pair<int, int32_t>>;  // (module index, calls)
  struct Census {
    int live = 0, left = 0, dead = 0;
  };

  // The group `index` of ranks [first_rank, first_rank + size).
  ShardGroup(int index, int first_rank, int size);

  int index = 0;
  std::vector<int> ranks;       // Ascending and contiguous.
  std::vector<Member> members;  // Parallel to `ranks`.
  v1::GroupState state = v1::GROUP_STATE_FORMING;
  int64_t epoch = 0;
  bool has_reference = false;
  v1::RegisterRequest reference;  // The first registration: manifest and policy.
  int reference_rank = -1;
  std::vector<ModuleSpec> modules;
  absl::flat_hash_map<std::string, int> module_index;
  std::unique_ptr<DecisionEngine> engine;  // Owns the group's one seq, for every policy.
  std::map<MicrobatchKey, PendingMicrobatch> pending;
  std::optional<MicrobatchKey> last_resolved;  // Decided or failed.
  std::optional<MicrobatchKey> last_decided;
  // Auto and per_layer: the last key the engine decided in this epoch (it decides in key order).
  std::optional<MicrobatchKey> last_drained;
  std::deque<v1::MicrobatchDecision> history;
  // Decisions given, by module (every module of the manifest, from the first registration);
  // the group's totals are their sum.
  std::map<std::string, v1::DecisionCounts> module_counts;
  std::string failure_reason;
  // Whole at least once since the job (re)started in this process: a later FORMING -> HEALTHY
  // is a re-form in a new epoch.
  bool formed = false;
  // GROUP_STATE_RECOVERING (DESIGN 12): fails its missing members at this deadline;
  // plans resumed members send meanwhile wait here, in arrival order.
  absl::Time recovery_deadline = absl::InfiniteFuture();
  std::vector<std::pair<int, v1::MicrobatchPlan>> deferred_plans;
  // The cost model the engine decides by (manifest order), the members' maxima it follows, and
  // the smallest measured budget (with how many members measured one).
  std::vector<ModuleCostModel> cost_model;
  std::vector<ModuleCostModel> measured;
  int64_t registered_budget = 0;  // Smallest memory_budget_bytes of the members.
  int budget_reporters = 0;
  int64_t measured_budget = INT64_MAX;

  bool Has(int rank) const { return rank >= ranks.front() && rank <= ranks.back(); }
  int IndexOf(int rank) const { return rank - ranks.front(); }
  Member& member(int rank) { return members[IndexOf(rank)]; }
  const Member& member(int rank) const { return members[IndexOf(rank)]; }
  Census Count() const;
  int size() const { return static_cast<int>(ranks.size()); }

  // Plans member `idx` reported that are not resolved yet: computed, never cached.
  int PendingOf(int idx) const;
  // The same for every member at once (one pass over the pending microbatches).
  std::vector<int> PendingCounts() const;
  // Takes the manifest, policy and fallback of the group's first registration.
  void SetReference(const v1::RegisterRequest& req, const PromotionOptions& promotion);
  // Tells the engine the smallest memory budget of the members (auto's promotion); its seq
  // and state go on. Returns that budget.
  int64_t SetPromotionBudget();
  // Keeps member `idx`'s cost report (bounded by the manifest; bad numbers dropped; one per
  // kMinCostReportSpacing per member, whatever the client sends) and, when the group's cost
  // model moved by more than a tenth or its budget went down at all, hands the engine the new
  // one; returns what changed for the event ("" when the engine's model stays). The group's
  // maxima are kept incrementally: a report costs O(modules), and O(members) only when the
  // member that held a maximum lowers it.
  std::string TakeCosts(int idx, const v1::Heartbeat& heartbeat, absl::Time now);
  // A (re)registered member starts afresh: what its earlier process measured is dropped.
  void ForgetMeasures(int idx);
  // The smallest budget of the members: registered, lowered by what every member measured.
  int64_t EffectiveBudget() const;
  // The plan's key and calls checked against the manifest; `who` names the sender.
  absl::StatusOr<PlanCalls> ParsePlan(const v1::MicrobatchPlan& plan, const MicrobatchKey& key,
                                      const std::string& who) const;
  // RESOURCE_EXHAUSTED when `max` keys are pending already (for a new key).
  absl::Status CheckPendingRoom(const MicrobatchKey& key, const std::string& who, int max) const;
  // Stores member `idx`'s report of `key`; true when the key is new to the group.
  bool Report(const MicrobatchKey& key, int idx, const PlanCalls& calls, absl::Time now);
  // Resolves `key`: no longer pending, and the group has resolved up to it.
  void Resolve(std::map<MicrobatchKey, PendingMicrobatch>::iterator it);
  // Counts a decision given (by module and kind), and keeps it in the last `keep`.
  void RecordDecision(const v1::MicrobatchDecision& d, int keep);
  // Keys start afresh (a new epoch, a rerun): nothing pending or resolved, nothing planned.
  void RestartKeys();

 private:
  void TakeMemberCosts(Member& m, std::vector<ModuleCostModel> mine);
  void TakeMemberBudget(Member& m, int64_t bytes);
  void RecomputeMeasured();
  std::string UpdateCostModel();
};

// Cost reports a member sends closer together than this are dropped by the coordinator (the
// worker sends at most one per kCostReportInterval, 5 s).
inline constexpr absl::Duration kMinCostReportSpacing = absl::Seconds(4);

// A group and the mutex that guards it. The hot path takes it with the core's lock held
// shared; the clang build checks every access (tests/compile_fail/).
struct GroupSlot {
  GroupSlot(int index, int first_rank, int size) : group(index, first_rank, size) {}
  mutable absl::Mutex mu;
  ShardGroup group ABSL_GUARDED_BY(mu);
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_SHARD_GROUP_H_
