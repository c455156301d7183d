#include "decision_queue.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardcoord::internal {

absl::Status DecisionQueue::Add(const MicrobatchKey& key, int window, const std::string& where,
                                MicrobatchPlan plan) {
  if (last_reported_ && key <= *last_reported_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "out-of-order ", where, ": the previous plan was ", last_reported_->ToString(),
        "; report plans in increasing (step, microbatch) order"));
  }
  if (undecided_ >= window) {
    return absl::ResourceExhaustedError(absl::StrCat(where, " is beyond the lookahead window: ", undecided_,
                                                     " plans are undecided (window ", window,
                                                     "); GetDecision the oldest first"));
  }
  last_reported_ = key;
  Entry e;
  plan.key = key;
  e.plan = std::move(plan);
  entries_[key] = std::move(e);
  undecided_++;
  return absl::OkStatus();
}

void DecisionQueue::Resolve(Entry& e, State state) {
  if (e.state == State::kPending) undecided_--;
  e.state = state;
}

void DecisionQueue::Decide(const MicrobatchKey& key, MicrobatchDecision decision) {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.state != State::kPending) return;
  it->second.decision = std::move(decision);
  Resolve(it->second, State::kDecided);
}

void DecisionQueue::Reject(const MicrobatchKey& key, absl::Status why) {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.state != State::kPending) return;
  it->second.status = std::move(why);
  Resolve(it->second, State::kFailed);
}

void DecisionQueue::Fail(const MicrobatchKey& key, absl::Status why) {
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second.state != State::kFailed) {
    // Pending, or decided and not yet taken: the trainer must not run it.
    it->second.status = std::move(why);
    Resolve(it->second, State::kFailed);
  } else if (it == entries_.end() && last_taken_ && !(*last_taken_ < key)) {
    // Already taken and maybe run: the next Take says so.
    late_failure_ = absl::Status(why.code(), absl::StrCat(why.message(), " (the decision for ", key.ToString(),
                                                          " was already taken on this rank)"));
  }
}

int DecisionQueue::FailPending(const absl::Status& why) {
  int failed = 0;
  for (auto& [key, e] : entries_) {
    if (e.state != State::kPending) continue;
    e.status = why;
    Resolve(e, State::kFailed);
    failed++;
  }
  return failed;
}

void DecisionQueue::ResetKeys() {
  last_reported_.reset();
  last_taken_.reset();
  taken_.clear();
}

std::vector<MicrobatchDecision> DecisionQueue::Held() const {
  std::vector<MicrobatchDecision> out(taken_.begin(), taken_.end());
  for (const auto& [key, e] : entries_) {
    if (e.state == State::kDecided) out.push_back(e.decision);
  }
  return out;
}

std::vector<MicrobatchPlan> DecisionQueue::Undecided() const {
  std::vector<MicrobatchPlan> out;
  for (const auto& [key, e] : entries_) {
    if (e.state == State::kPending) out.push_back(e.plan);
  }
  return out;
}

bool DecisionQueue::Resolved(const MicrobatchKey& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() || it->second.state != State::kPending;
}

absl::StatusOr<MicrobatchDecision> DecisionQueue::Take(const MicrobatchKey& key) {
  auto it = entries_.find(key);
  absl::StatusOr<MicrobatchDecision> out = it->second.state == State::kDecided
                                               ? absl::StatusOr<MicrobatchDecision>(it->second.decision)
                                               : absl::StatusOr<MicrobatchDecision>(it->second.status);
  if (!late_failure_.ok() && out.ok()) {
    out = late_failure_;
    late_failure_ = absl::OkStatus();
  }
  if (!last_taken_ || *last_taken_ < key) last_taken_ = key;
  if (it->second.state == State::kDecided) {
    taken_.push_back(it->second.decision);
    while (taken_.size() > kHeldHistory) taken_.pop_front();
  }
  for (auto e = entries_.begin(); e != std::next(it); ++e) {
    if (e->second.state == State::kPending) Resolve(e->second, State::kFailed);
  }
  entries_.erase(entries_.begin(), std::next(it));
  return out;
}

}  // namespace shardcoord::internal
