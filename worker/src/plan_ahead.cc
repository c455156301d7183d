#include "shardcoord/plan_ahead.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardcoord {

PlanAhead::PlanAhead(Worker& worker, int64_t total, PlanFn plan_of, int lookahead)
    : worker_(worker),
      total_(total),
      plan_of_(std::move(plan_of)),
      lookahead_(std::max(1, lookahead > 0 ? lookahead : worker.group().lookahead)) {}

absl::StatusOr<MicrobatchDecision> PlanAhead::Next(absl::Duration timeout) {
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
