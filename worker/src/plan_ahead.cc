#include "shardcoord/plan_ahead.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardcoord {

PlanAhead::PlanAhead(Worker& worker, int64_t total, PlanFn plan_of, int lookahead)
    : worker_(worker),
      total_(total),
      plan_of_(std::move(plan_of)),
      lookahead_(lookahead != 0 ? lookahead : worker.group().lookahead) {}

absl::StatusOr<MicrobatchDecision> PlanAhead::Next(absl::Duration timeout) {
  // As Python's PlanAhead: more plans ahead than the window would be refused by the worker,
  // fewer than one would report none; said at the first call (a constructor returns no error).
  if (const int window = worker_.group().lookahead; lookahead_ < 1 || lookahead_ > window) {
    return absl::InvalidArgumentError(absl::StrCat("PlanAhead: lookahead ", lookahead_, " must be in 1..", window,
                                                   " (the group's lookahead window, as registered)"));
  }
  if (done()) {
    return absl::FailedPreconditionError(
        absl::StrCat("PlanAhead: all ", total_, " microbatches were already returned"));
  }
  while (reported_ < total_ && reported_ < next_ + lookahead_) {
    MicrobatchPlan plan = plan_of_(reported_);
    if (absl::Status s = worker_.ReportPlan(plan); !s.ok()) return s;
    plans_.push_back(std::move(plan));
    ++reported_;
  }
  plan_ = std::move(plans_.front());
  plans_.pop_front();
  ++next_;
  return worker_.GetDecision(plan_.key, timeout);
}

}  // namespace shardcoord
