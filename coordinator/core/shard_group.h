// ShardGroup: one shard group's state (its members, epoch, manifest, decision engine,
// pending microbatches, history and counts) and its rules (DESIGN 3 and 8): plan intake and
// decisions for every policy, the group's state machine, leaves and deaths, recovery after a
// restart. Its operations change the group and return what follows outside it as
// GroupEffects (messages for members, events, log lines, counters), which the core carries
// out; the group itself never sends, journals or touches another group, a session or a
// communicator (only a broken invariant is logged at once, invariant.h).
// Like DecisionEngine it is not thread-safe: the core keeps each group in a GroupSlot, whose
// mutex guards it (ABSL_GUARDED_BY), so that the clang build's lock analysis refuses code
// that touches a group without holding that mutex (DESIGN 9), on the hot path and on the
// core's exclusive paths alike (GroupMutex::LockNested).
#ifndef SHARDCOORD_COORDINATOR_CORE_SHARD_GROUP_H_
#define SHARDCOORD_COORDINATOR_CORE_SHARD_GROUP_H_

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/core/buffer_budget.h"
#include "coordinator/engine/decision_engine.h"
#include "coordinator/core/group_effects.h"
#include "coordinator/core/registration.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/core/scoped_lock.h"
#include "coordinator/core/session_binding.h"
#include "coordinator/core/worker_report.h"
#include "coordinator/settings/options.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

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
// Which registration of a rank the holder of its slot proved (DESIGN 12): the coordinator
// process that answered it and that answer's serial (RegisterResponse.incarnation,
// .registration). None ({0, 0}): a fresh registration while its group recovers, or a resume
// nothing could verify. A verified resume of a newer registration takes the slot from its
// holder; one of an older registration is refused: a process that was the rank earlier in the
// run cannot keep out the one that holds the rank's newest credential.
struct RegistrationClaim {
  uint64_t incarnation = 0;
  uint64_t serial = 0;
  friend bool operator<(const RegistrationClaim& a, const RegistrationClaim& b) {
    return std::tie(a.incarnation, a.serial) < std::tie(b.incarnation, b.serial);
  }
};

struct Member {
  int rank = 0;
  int group = 0;
  v1::RankState state = v1::RANK_STATE_UNREGISTERED;
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
  std::vector<ModuleMemoryUsage> memory;  // As last reported.
  // As last reported, per manifest module (empty: none yet): forward and the sum of its
  // units' gathers, no names (a 16k-rank group holds two numbers per rank and module).
  std::vector<ModuleCostModel> costs;
  int64_t frozen_budget = 0;                               // Measured by the rank; 0: not reported.
  absl::Time costs_taken = absl::InfinitePast();           // When its last report was taken.
  ReportedTotal decision_stalls, decision_stall_us;  // From heartbeats, across worker restarts.
  std::map<std::string, ReportedTotal> gathered_bytes;  // By module of the manifest, likewise.
  RegistrationClaim claim;    // What its holder proved, kept when it dies or leaves.
  // What the rank held when it resumed after a restart, until its group recovered;
  // its memory is charged to the daemon's buffers meanwhile.
  std::optional<v1::ResumeState> resume;
  BufferCharge resume_charge;

  bool live() const { return state == v1::RANK_STATE_LIVE; }
  // Whether the rank can no longer report `key` (one it has not reported): it left (a rank
  // that comes back registers afresh, its earlier keys failed or decided by then), or it
  // planned past the key (plans come in key order).
  bool WillNeverReport(const MicrobatchKey& key) const {
    if (state == v1::RANK_STATE_LEFT) return true;
    return last_planned && key < *last_planned;
  }
};

// One module's decisions by kind (in decisions.def order) and how many of them were for
// divergent calls: counted on the plan path as array slots, made a DecisionCounts only when
// an operator asks.
struct DecisionTally {
  std::array<int64_t, kNumDecisions> by_kind{};
  int64_t divergent = 0;
  void Count(const v1::ModuleDecision& md);
  v1::DecisionCounts ToProto() const;
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

// What a group's operations need of the daemon, fixed for the group's life.
struct GroupRules {
  std::string job_id;
  const CoordinatorOptions* options = nullptr;  // Limits, timeouts, history kept.
  const ResumeAuthority* auth = nullptr;        // Seals the decisions.
};

class ShardGroup {
 public:
  using PlanCalls = std::vector<std::pair<int, int32_t>>;  // (module index, calls)
  struct Census {
    int live = 0, left = 0, dead = 0;
  };

  // The group `index` of ranks [first_rank, first_rank + size) of job rules.job_id.
  ShardGroup(int index, int first_rank, int size, GroupRules rules);

  // --- Operations. Each appends to `fx` what the core is to carry out; member arguments are
  // indexes in the group (IndexOf).
  // shard_group_plans.cc: plans and decisions (DESIGN 3).
  // A bundle's plans from live member `idx`: each accepted or rejected (PlanRejected), the
  // decisions that became ready given; held while the group recovers.
  void TakePlans(int idx, const PlanBatchReport& batch, absl::Time now, GroupEffects& fx);
  // A heartbeat's part that concerns the member and the group's cost model: liveness, memory,
  // measured costs (collective progress is the communicators').
  void TakeHeartbeat(int idx, const HeartbeatReport& heartbeat, absl::Time now, GroupEffects& fx);
  // Fails microbatches pending longer than the plan timeout.
  void ExpirePlans(absl::Time now, GroupEffects& fx);
  // Decides pending microbatches from the front while every member has reported.
  void Drain(absl::Time now, GroupEffects& fx);
  // shard_group_states.cc: the state machine (DESIGN 8), leaves, deaths and recovery (DESIGN 12).
  // FORMING -> HEALTHY -> FAILED -> FORMING (epoch + 1), FINISHED when every member left.
  void UpdateState(GroupEffects& fx);
  // Tells the other members the group re-formed because `rank` registered again.
  void AnnounceReformed(int rank, GroupEffects& fx);
  // Member `idx` left cleanly: what it never planned fails; the rest may still be decided.
  void OnLeft(int idx, absl::Time now, GroupEffects& fx);
  // Member `idx`, marked dead by the caller (`full` says why): the group fails, everything
  // pending is cancelled. Returns the failure's reason, for the rest of the job.
  std::string Fail(int idx, const std::string& full, GroupEffects& fx);
  // True for a group that has done nothing in this process: forming, no live member.
  bool IsFresh() const;
  // A rank resumed after a coordinator restart: the group waits for every member.
  void StartRecovery(absl::Time now, GroupEffects& fx);
  // A member resumed: once every member is live and has resumed, the recovery rule is
  // applied (held decisions binding, contradictions fail the group, recovery.h).
  void MaybeFinishRecovery(absl::Time now, GroupEffects& fx);
  // Past the recovery deadline: members that did not resume are marked dead and returned;
  // `each` is the reason each is given, `why` the group's. The core then tells their
  // communicators and, when the list is not empty, fails the group (Fail).
  std::vector<int> ExpireRecovery(absl::Time now, std::string* why, std::string* each, GroupEffects& fx);

  // Read-only views for the core and the status pages; the group's own operations write.
  int index() const { return index_; }
  const std::vector<int>& ranks() const { return ranks_; }
  v1::GroupState state() const { return state_; }
  int64_t epoch() const { return epoch_; }
  bool has_reference() const { return has_reference_; }
  const Registration& reference() const { return reference_; }
  int reference_rank() const { return reference_rank_; }
  const std::vector<ModuleSpec>& modules() const { return modules_; }
  const std::deque<v1::MicrobatchDecision>& history() const { return history_; }
  const std::map<std::string, DecisionTally>& module_counts() const { return module_counts_; }
  const std::string& failure_reason() const { return failure_reason_; }
  bool formed() const { return formed_; }
  // The plan path's effects list, reused from one batch to the next (CoordinatorCore::TakePlans
  // fills it through the group's operations and applies it): empty between operations, its
  // vectors keeping their room.
  GroupEffects& effects() { return effects_; }
  // The members, read-only: the group's operations write them (MemberLive, MemberGone,
  // MemberSeen, SetClaim, HoldResume, and the plan and heartbeat paths).
  const std::vector<Member>& members() const { return members_; }
  // The core's session of each member (SessionBinding); the group's own operations never touch it.
  SessionBinding& binding(int rank) { return bindings_[IndexOf(rank)]; }
  const SessionBinding& binding(int rank) const { return bindings_[IndexOf(rank)]; }
  SessionBinding& binding_at(int idx) { return bindings_[idx]; }
  // An ended job keeps its last `keep` decisions of history (CoordinatorCore's sweep).
  void TrimHistory(size_t keep);

  bool Has(int rank) const { return rank >= ranks_.front() && rank <= ranks_.back(); }
  int IndexOf(int rank) const { return rank - ranks_.front(); }
  const Member& member(int rank) const { return members_[IndexOf(rank)]; }
  Census Count() const;
  int size() const { return static_cast<int>(ranks_.size()); }
  // A rank's life state has one writer, the group: these two for the core (a rank registered,
  // or left or died), and the group's own rules (recovery expiry, a rerun). MemberLive also
  // takes what the registration says of the rank (host, pid, lookahead, budget) and starts it
  // afresh (no plans, no resume held, seen now).
  void MemberLive(int rank, const Registration& req, absl::Time now);
  void MemberGone(int rank, bool clean, const std::string& reason);
  // The rest of what the core records of a member: a sign of life outside the plan path, what it
  // proved when registering (RegistrationClaim), what it held when it resumed after a restart.
  void MemberSeen(int rank, absl::Time now);
  void SetClaim(int rank, const RegistrationClaim& claim);
  void HoldResume(int rank, v1::ResumeState resume, BufferCharge charge);
  // A pause of the daemon: every live member's heartbeat deadline starts again at `now`;
  // returns how many there were.
  int RestartHeartbeatDeadlines(absl::Time now);

  // Plans member `idx` reported that are not resolved yet: computed, never cached.
  int PendingOf(int idx) const;
  // The same for every member at once (one pass over the pending microbatches).
  std::vector<int> PendingCounts() const;
  // Takes the manifest, policy and fallback of the group's first registration.
  void SetReference(const Registration& req, const PromotionOptions& promotion);
  // Tells the engine the smallest memory budget of the members (auto's promotion); its seq
  // and state go on. Returns that budget.
  int64_t SetPromotionBudget();
  // Keeps member `idx`'s cost report (bounded by the manifest; bad numbers dropped; one per
  // kMinCostReportSpacing per member, whatever the client sends) and, when the group's cost
  // model moved by more than a tenth or its budget went down at all, hands the engine the new
  // one; returns what changed for the event ("" when the engine's model stays). The group's
  // maxima are kept incrementally: a report costs O(modules), and O(members) only when the
  // member that held a maximum lowers it.
  std::string TakeCosts(int idx, const HeartbeatReport& heartbeat, absl::Time now);
  // A (re)registered member starts afresh: what its earlier process measured is dropped.
  void ForgetMeasures(int idx);
  // The smallest budget of the members: registered, lowered by what every member measured.
  int64_t EffectiveBudget() const;
  // The plan's key and calls checked against the manifest; `who` names the sender.
  absl::StatusOr<PlanCalls> ParsePlan(const MicrobatchPlan& plan, const std::string& who) const;
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
  // A rerun of the job under the same id (every rank had left): the group takes the manifest
  // of its first rank to register again and forms afresh, its keys from the start, its
  // decisions sealed by `run_auth` (the new run's).
  void StartRerun(const ResumeAuthority* run_auth);
  // shard_group_status.cc: the RegisterResponse of a rank joining the group (its group, the
  // timeouts, the policy it registered, the last key decided, the coordinator's incarnation and
  // config digest);
  v1::CoordinatorMessage Registered(const Registration& req, uint64_t incarnation, uint64_t config_digest) const;
  // the group's share of its job's status (rank and group counts,
  // decisions by kind, the module names), its own status, and one status per member.
  void CountInto(v1::JobStatus* out) const;
  void Describe(v1::GroupStatus* out) const;
  void DescribeMembers(absl::Time now, google::protobuf::RepeatedPtrField<v1::RankStatus>* out) const;
  // Appends the newest `limit` decisions, counting their size into `bytes`; false, with what
  // fitted appended, once `bytes` would pass `max_bytes`.
  bool DescribeHistory(int limit, size_t max_bytes, size_t* bytes, v1::ListDecisionsResponse* out) const;
  const GroupRules& rules() const { return rules_; }
  // Read-only views of the group's own state (tests, status).
  const std::map<MicrobatchKey, PendingMicrobatch>& pending() const { return pending_; }
  const std::optional<MicrobatchKey>& last_resolved() const { return last_resolved_; }
  const std::optional<MicrobatchKey>& last_decided() const { return last_decided_; }
  absl::Time recovery_deadline() const { return recovery_deadline_; }
  const std::vector<std::pair<int, MicrobatchPlan>>& deferred_plans() const { return deferred_plans_; }
  const std::vector<ModuleCostModel>& cost_model() const { return cost_model_; }

 private:
  Member& mutable_member(int rank) { return members_[IndexOf(rank)]; }
  int index_ = 0;
  std::vector<int> ranks_;       // Ascending and contiguous.
  std::vector<Member> members_;  // Parallel to `ranks_`.
  std::vector<SessionBinding> bindings_;  // Parallel to `ranks_`; the core's (binding()).
  v1::GroupState state_ = v1::GROUP_STATE_FORMING;
  int64_t epoch_ = 0;
  bool has_reference_ = false;
  Registration reference_;  // The first registration: manifest and policy.
  int reference_rank_ = -1;
  std::vector<ModuleSpec> modules_;
  GroupEffects effects_;
  std::deque<v1::MicrobatchDecision> history_;
  // Decisions given, by module (every module of the manifest, from the first registration);
  // the group's totals are their sum.
  std::map<std::string, DecisionTally> module_counts_;
  std::string failure_reason_;
  // Whole at least once since the job (re)started in this process: a later FORMING -> HEALTHY
  // is a re-form in a new epoch.
  bool formed_ = false;
  // The group's own state: only its operations change it.
  absl::flat_hash_map<std::string, int> module_index_;
  std::unique_ptr<DecisionEngine> engine_;  // Owns the group's one seq, for every policy.
  std::map<MicrobatchKey, PendingMicrobatch> pending_;
  std::optional<MicrobatchKey> last_resolved_;  // Decided or failed.
  std::optional<MicrobatchKey> last_decided_;
  // Auto and per_layer: the last key the engine decided in this epoch (it decides in key order).
  std::optional<MicrobatchKey> last_drained_;
  // GROUP_STATE_RECOVERING (DESIGN 12): fails its missing members at this deadline;
  // plans resumed members send meanwhile wait here, in arrival order.
  absl::Time recovery_deadline_ = absl::InfiniteFuture();
  std::vector<std::pair<int, MicrobatchPlan>> deferred_plans_;
  // The cost model the engine decides by (manifest order), the members' maxima it follows, and
  // the smallest measured budget (with how many members measured one).
  std::vector<ModuleCostModel> cost_model_;
  std::vector<ModuleCostModel> measured_;
  int64_t registered_budget_ = 0;  // Smallest memory_budget_bytes of the members.
  int budget_reporters_ = 0;
  int64_t measured_budget_ = INT64_MAX;

  // Plan intake (shard_group_plans.cc).
  absl::Status AcceptPlan(int idx, const MicrobatchPlan& plan, absl::Time now, GroupEffects& fx);
  // Whether the group can take `key` from member `idx` now: in order, the group not failed,
  // the key not resolved already, within the member's lookahead window and the group's room.
  absl::Status CheckPlanFits(int idx, const MicrobatchKey& key, const std::string& who) const;
  // Fails earlier pending microbatches member `idx` skipped by reporting `key`, and `key`
  // itself when other members already moved past it. False if `key` failed.
  bool FailSkipped(int idx, const MicrobatchKey& key, bool inserted, GroupEffects& fx);
  // Static policies: the decision for `key`, made once, when the first rank reports it.
  void DecideStatic(const MicrobatchKey& key, absl::Time now, GroupEffects& fx);
  v1::MicrobatchDecision Sealed(const MicrobatchDecision& d, absl::Time now) const;
  void Given(const v1::MicrobatchDecision& d, GroupEffects& fx);
  void FailMicrobatch(const MicrobatchKey& key, const absl::Status& why, GroupEffects& fx);
  // The messages that tell members `key` failed, and that the group failed (reason `why`).
  v1::CoordinatorMessage MicrobatchFailed(const MicrobatchKey& key, const absl::Status& why) const;
  v1::CoordinatorMessage GroupFailed(const std::string& why) const;
  // Answers member `idx`'s plan of `key` (none: the plan had no key) with PlanRejected.
  void Reject(int idx, const std::optional<MicrobatchKey>& key, const absl::Status& why, int64_t epoch,
              GroupEffects& fx);
  // Recovery (shard_group_states.cc).
  void FinishRecovery(absl::Time now, GroupEffects& fx);
  void FailRecovery(const std::string& why, GroupEffects& fx);
  // Static policies: binding keys some member has not reported yet stay pending with their
  // decision, for that member to receive when it does.
  void KeepStaticBinding(const MicrobatchKey& key, const v1::MicrobatchDecision& d, absl::Time now);
  // Replays plans (resumed, then deferred) through the ordinary intake.
  void ReplayPlans(const std::vector<std::pair<int, MicrobatchPlan>>& plans, absl::Time now, GroupEffects& fx);
  void DropResumes();

  GroupRules rules_;
  void TakeMemberCosts(Member& m, std::vector<ModuleCostModel> mine);
  void TakeMemberBudget(Member& m, int64_t bytes);
  void RecomputeMeasured();
  std::string UpdateCostModel();
};

// Cost reports a member sends closer together than this are dropped by the coordinator (the
// worker sends at most one per kCostReportInterval, 5 s).
inline constexpr absl::Duration kMinCostReportSpacing = absl::Seconds(4);

// The mutex of one shard group (GroupSlot::mu). Two kinds of holder take it:
// - a thread holding the core's lock shared (the hot path, the status queries) takes it with
//   GroupLock, once, and holds no other group's meanwhile;
// - the holder of the core's lock exclusively takes it with LockNested (CoordinatorCore::
//   HeldGroup), as it goes: its operations nest (a death found while scanning a group removes
//   a member of that same group, whose removal scans the job's groups again), so a nested
//   take of a mutex this holder already took only counts.
// LockNested never waits: the group mutexes are only taken under the core's lock shared, so
// while it is held exclusively no other thread holds one. A take that finds it held all the
// same is reported (returns false) and then waits for it. The analysis checks both kinds, so
// every access to a group's state is checked by the compiler (tests/compile_fail/).
class ABSL_LOCKABLE GroupMutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.Lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.Unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.TryLock(); }
  // Only with the core's lock held exclusively (`nested_` is guarded by it).
  bool LockNested() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    if (nested_++ > 0 || mu_.TryLock()) return true;
    mu_.Lock();
    return false;
  }
  void UnlockNested() ABSL_UNLOCK_FUNCTION() {
    if (--nested_ == 0) mu_.Unlock();
  }

 private:
  absl::Mutex mu_;
  int nested_ = 0;  // LockNested's depth: written only under the core's lock held exclusively.
};

// GroupMutex held for a scope, by a holder of the core's lock shared.
using GroupLock = ExclusiveLock<GroupMutex>;

// A group and the mutex that guards it. The clang build checks every access
// (tests/compile_fail/). The mutex is only ever taken exclusively: clang counts a call of a
// group operation as a read of `group`, so a reader lock on `mu` around a changing operation
// would not be flagged.
struct GroupSlot {
  GroupSlot(int index, int first_rank, int size, GroupRules rules) : group(index, first_rank, size, std::move(rules)) {}
  mutable GroupMutex mu;
  ShardGroup group ABSL_GUARDED_BY(mu);
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_SHARD_GROUP_H_
