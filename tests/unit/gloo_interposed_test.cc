// The Gloo communicator refuses, with an error that says what to do, to run in a process whose
// Gloo functions come from another library than libgloo (DESIGN 4; gloo_communicator.cc,
// GlooIsItsOwnLibrary). The test runs itself again with tests/support/gloo_interposer.cc
// preloaded: before the check, the same situation was a segfault in the first connect (LibTorch
// 2.11 from pip, on the GPU machine).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "comm_base.h"
#include "rendezvous.h"
#include "support/subprocess.h"

namespace shardcoord::internal {
namespace {

using ::testing::HasSubstr;

// Records what the communicator reports; publishes and fetches nothing (it must not get there).
class RecordingRendezvous final : public EpochRendezvous {
 public:
  absl::Status Publish(const std::string& key, const std::string&) override {
    published.push_back(key);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> Fetch(const std::vector<std::string>& keys, absl::Duration) override {
    return absl::DeadlineExceededError("nothing is published in this test");
  }
  absl::Status ReportReady() override { return absl::OkStatus(); }
  absl::Status ReportError(const std::string& error) override {
    errors.push_back(error);
    return absl::OkStatus();
  }
  std::vector<std::string> published, errors;
};

// Runs only in the child the next test starts, with the interposer preloaded.
TEST(GlooInterposedTest, DISABLED_InTheChild) {
  const char* preload = std::getenv("LD_PRELOAD");
  ASSERT_NE(preload, nullptr) << "started by ConnectRefusesWithWhatToDoAndReportsItToTheEpoch";
  ASSERT_THAT(preload, HasSubstr("gloo_interposer"));
  auto rendezvous = std::make_shared<RecordingRendezvous>();
  CommunicatorOptions options;
  options.name = "world";
  CommSpec spec{"job", 3, "world", 1, {3, 4}, options};
  auto comm = MakeGlooCommunicator(rendezvous, std::move(spec));
  const absl::Status s = comm->Connect();  // The interposed CreateDevice aborts if it is reached.
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("communicator 'world'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("gloo_interposer"));  // Where the functions come from.
  EXPECT_THAT(std::string(s.message()), HasSubstr("libgloo.so.0"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("before the Torch libraries"));  // What to do.
  EXPECT_TRUE(rendezvous->published.empty());
  ASSERT_EQ(rendezvous->errors.size(), 1u) << "the other members learn the cause from the epoch's abort";
  EXPECT_THAT(rendezvous->errors[0], HasSubstr("rank 3"));
}

TEST(GlooInterposedTest, ConnectRefusesWithWhatToDoAndReportsItToTheEpoch) {
  const char* asan = std::getenv("ASAN_OPTIONS");
  auto run = shardcoord::testing::RunCommand(
      {"/proc/self/exe", "--gtest_also_run_disabled_tests", "--gtest_filter=GlooInterposedTest.DISABLED_InTheChild"},
      absl::Seconds(60),
      {absl::StrCat("LD_PRELOAD=", SHARDCOORD_GLOO_INTERPOSER),
       // A preloaded library comes before the sanitizer's runtime in sanitized builds.
       absl::StrCat("ASAN_OPTIONS=", asan == nullptr ? "" : asan, asan == nullptr ? "" : ":",
                    "verify_asan_link_order=0")});
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_THAT(run.out, HasSubstr("[  PASSED  ] 1 test")) << run.out;
  EXPECT_THAT(run.err, ::testing::Not(HasSubstr("interposed CreateDevice was called")));
}

}  // namespace
}  // namespace shardcoord::internal
