// Unit tests of the worker's lookahead window (worker/src/decision_queue.h).
#include "decision_queue.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace {

using shardcoord::MicrobatchDecision;
using shardcoord::MicrobatchKey;
using shardcoord::internal::DecisionQueue;
using ::testing::HasSubstr;

MicrobatchDecision DecisionFor(MicrobatchKey key, uint64_t seq) {
  MicrobatchDecision d;
  d.key = key;
  d.seq = seq;
  return d;
}

TEST(DecisionQueueTest, KeysIncreaseAndTheWindowIsBounded) {
  DecisionQueue q;
  ASSERT_TRUE(q.Add({0, 0}, 2, "plan (0,0)").ok());
  ASSERT_TRUE(q.Add({0, 1}, 2, "plan (0,1)").ok());
  absl::Status full = q.Add({0, 2}, 2, "plan (0,2)");
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("plan (0,2) is beyond the lookahead window: 2 plans are undecided"));
  absl::Status order = q.Add({0, 1}, 4, "plan (0,1)");
  EXPECT_EQ(order.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(order.message(), HasSubstr("the previous plan was (0,1)"));
  EXPECT_EQ(q.undecided(), 2);
  q.Decide({0, 0}, DecisionFor({0, 0}, 7));
  EXPECT_EQ(q.undecided(), 1);
  EXPECT_TRUE(q.Add({0, 2}, 2, "plan (0,2)").ok()) << "a decided entry frees its place in the window";
}

TEST(DecisionQueueTest, TakeReturnsTheOutcomeAndDropsEverythingUpToTheKey) {
  DecisionQueue q;
  for (int mb = 0; mb < 3; ++mb) ASSERT_TRUE(q.Add({0, mb}, 4, "p").ok());
  q.Decide({0, 1}, DecisionFor({0, 1}, 1));
  EXPECT_FALSE(q.Resolved({0, 0}));
  EXPECT_TRUE(q.Resolved({0, 1}));
  auto d = q.Take({0, 1});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->seq, 1u);
  EXPECT_FALSE(q.Contains({0, 0})) << "the trainer moved past it";
  EXPECT_FALSE(q.Contains({0, 1}));
  EXPECT_TRUE(q.Contains({0, 2}));
  EXPECT_EQ(q.undecided(), 1);
  q.Decide({0, 2}, DecisionFor({0, 2}, 2));
  q.Decide({0, 2}, DecisionFor({0, 2}, 99));  // A second decision for a resolved key is ignored.
  EXPECT_EQ(q.Take({0, 2})->seq, 2u);
}

TEST(DecisionQueueTest, FailuresRejectionsAndLateFailures) {
  DecisionQueue q;
  for (int mb = 0; mb < 4; ++mb) ASSERT_TRUE(q.Add({0, mb}, 4, "p").ok());
  q.Reject({0, 0}, absl::InvalidArgumentError("bad plan"));
  EXPECT_EQ(q.Take({0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  q.Decide({0, 1}, DecisionFor({0, 1}, 1));
  q.Fail({0, 1}, absl::FailedPreconditionError("rank 1 skipped it"));  // Withdraws a decision not taken.
  EXPECT_THAT(q.Take({0, 1}).status().message(), HasSubstr("rank 1 skipped it"));
  q.Fail({0, 1}, absl::FailedPreconditionError("the plan timeout passed"));  // Already taken: late.
  EXPECT_THAT(q.late_failure().message(), HasSubstr("(the decision for (0,1) was already taken on this rank)"));
  q.Decide({0, 2}, DecisionFor({0, 2}, 2));
  auto late = q.Take({0, 2});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << "reported by the next take";
  EXPECT_TRUE(q.late_failure().ok());
  EXPECT_EQ(q.FailPending(absl::AbortedError("group failed")), 1);
  EXPECT_EQ(q.Take({0, 3}).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(q.undecided(), 0);
}

TEST(DecisionQueueTest, ANewEpochStartsTheKeysAfresh) {
  DecisionQueue q;
  ASSERT_TRUE(q.Add({5, 0}, 4, "p").ok());
  q.FailPending(absl::AbortedError("group failed"));
  q.ResetKeys();
  EXPECT_TRUE(q.Add({0, 0}, 4, "p").ok()) << "a job resumed from a checkpoint plans earlier steps again";
}

}  // namespace
