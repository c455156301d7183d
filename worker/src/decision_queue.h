// The worker's lookahead window (DESIGN 3, "Timing"): one entry per reported plan, in key
// order, until the trainer takes its decision. Not thread-safe: Worker::Impl guards it with
// its mutex and waits on Resolved() for a key.
//
// Rules:
// - Add: keys strictly increasing (since the last ResetKeys), at most `window` undecided.
// - A decision, a rejection or a failure resolves a pending entry; a failure also withdraws
//   a decision not taken yet (static policies decide before the group has reported), and a
//   failure of a key already taken is kept for the next Take (the trainer may have run it).
// - Take(key) returns the entry's outcome and drops every entry up to the key: the trainer
//   moves forward, so earlier undecided entries are abandoned.
// - For a resume after a coordinator restart (DESIGN 12) it remembers the plan of each
//   undecided entry and the last kHeldHistory decisions taken in this epoch.
#ifndef SHARDCOORD_WORKER_SRC_DECISION_QUEUE_H_
#define SHARDCOORD_WORKER_SRC_DECISION_QUEUE_H_

#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shardcoord/types.h"

namespace shardcoord::internal {

// Taken decisions kept for a resume: a rank behind by more than this many microbatches
// could not be given the decisions its group already ran (the coordinator then fails
// those keys for it, naming the restart).
inline constexpr size_t kHeldHistory = 1024;

class DecisionQueue {
 public:
  // Adds the plan of `key`; `where` names it in errors. FAILED_PRECONDITION out of order,
  // RESOURCE_EXHAUSTED beyond the window.
  absl::Status Add(const MicrobatchKey& key, int window, const std::string& where, MicrobatchPlan plan = {});

  // The coordinator's decision for `key` (ignored unless pending).
  void Decide(const MicrobatchKey& key, MicrobatchDecision decision);
  // The coordinator refused the plan of `key` (ignored unless pending).
  void Reject(const MicrobatchKey& key, absl::Status why);
  // `key` can never run (a rank skipped it, the plan timeout passed).
  void Fail(const MicrobatchKey& key, absl::Status why);
  // Every pending entry fails with `why` (group failure, session lost); returns how many.
  int FailPending(const absl::Status& why);
  // A new epoch: keys start afresh (and the taken decisions are forgotten).
  void ResetKeys();

  // What a resume reports: every decision received in this epoch that is still known
  // (taken, newest kHeldHistory, then decided and not taken), and the plans still undecided.
  std::vector<MicrobatchDecision> Held() const;
  std::vector<MicrobatchPlan> Undecided() const;

  bool Contains(const MicrobatchKey& key) const { return entries_.count(key) > 0; }
  // Absent (taken by another thread) or no longer pending: a waiter may stop waiting.
  bool Resolved(const MicrobatchKey& key) const;
  int undecided() const { return undecided_; }
  // A failure of a key already taken, until the next Take reports it.
  const absl::Status& late_failure() const { return late_failure_; }

  // The outcome of a resolved `key` (the pending late failure first, if any) and drops
  // every entry up to it. Precondition: Contains(key) && Resolved(key).
  absl::StatusOr<MicrobatchDecision> Take(const MicrobatchKey& key);

 private:
  enum class State { kPending, kDecided, kFailed };
  struct Entry {
    State state = State::kPending;
    MicrobatchDecision decision;
    absl::Status status;
    MicrobatchPlan plan;
  };
  void Resolve(Entry& e, State state);

  std::map<MicrobatchKey, Entry> entries_;
  int undecided_ = 0;
  std::optional<MicrobatchKey> last_reported_;
  std::optional<MicrobatchKey> last_taken_;  // Newest key Take returned.
  absl::Status late_failure_;                // A key failed after it was taken.
  std::deque<MicrobatchDecision> taken_;     // Newest kHeldHistory taken decisions.
};

}  // namespace shardcoord::internal

#endif  // SHARDCOORD_WORKER_SRC_DECISION_QUEUE_H_
