// PlanAhead: keeps a rank's plans reported `lookahead` microbatches ahead of its training
// loop, so that decisions are normally decided before the loop asks (the cost on the
// critical path is then a queue pop). The one plan-ahead loop; trainers need not write
// their own.
//
//   shardcoord::PlanAhead ahead(*worker, steps * accum, [&](int64_t i) {
//     return shardcoord::MicrobatchPlan{{i / accum, int32_t(i % accum)},
//                                       {{"model.visual", HasImages(i) ? 1 : 0}}};
//   });
//   while (!ahead.done()) {
//     auto d = ahead.Next(absl::Seconds(60));   // the decision of the next microbatch
//     if (!d.ok()) ...                          // the worker's errors, unchanged
//   }
//
// Not thread-safe: one training loop drives it.
#ifndef SHARDCOORD_PLAN_AHEAD_H_
#define SHARDCOORD_PLAN_AHEAD_H_

#include <cstdint>
#include <deque>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shardcoord/export.h"
#include "shardcoord/types.h"
#include "shardcoord/worker.h"

namespace shardcoord {

class SHARDCOORD_EXPORT PlanAhead {
 public:
  // The plan of the i-th microbatch (0 <= i < total), keys increasing with i.
  using PlanFn = std::function<MicrobatchPlan(int64_t index)>;

  // `lookahead` 0 takes the group's (as registered); another value must be in 1..the group's
  // (Next says INVALID_ARGUMENT otherwise, as Python's PlanAhead does at construction).
  PlanAhead(Worker& worker, int64_t total, PlanFn plan_of, int lookahead = 0);

  // Reports the plans up to `lookahead` microbatches past the next one, then waits at most
  // `timeout` for the next microbatch's decision, and moves on. Errors: the worker's
  // (ReportPlan's or GetDecision's, with the key in the message); INVALID_ARGUMENT for a
  // lookahead outside the group's window; FAILED_PRECONDITION after the last microbatch.
  absl::StatusOr<MicrobatchDecision> Next(absl::Duration timeout);

  bool done() const { return next_ >= total_; }
  // The index of the microbatch Next() returns next.
  int64_t index() const { return next_; }
  // The key of the microbatch Next() returned last.
  const MicrobatchKey& key() const { return plan_.key; }
  // The plan reported for it: its `calls` are what an executor's BeginMicrobatch takes (the
  // calls a padded decision pads up from), exactly those the group decided on.
  const MicrobatchPlan& plan() const { return plan_; }

 private:
  Worker& worker_;
  const int64_t total_;
  const PlanFn plan_of_;
  const int lookahead_;
  int64_t next_ = 0;      // Next microbatch to return.
  int64_t reported_ = 0;  // Plans reported so far.
  std::deque<MicrobatchPlan> plans_;  // Reported and not yet returned, oldest first.
  MicrobatchPlan plan_;
};

}  // namespace shardcoord

#endif  // SHARDCOORD_PLAN_AHEAD_H_
