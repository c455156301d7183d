// GPU tier: the NCCL backend through a real shardcoordd, two rank processes on two GPUs.
// Skips cleanly where fewer than two GPUs are visible (CI, the development machines); run
// on the GPU machine with scripts/gpu/run_nccl_test.sh (results in docs/GPU.md).
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "support/daemon.h"
#include "support/subprocess.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

int GpuCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

TEST(NcclCommTest, TwoRanksOnTwoGpusRunCheckedCollectives) {
  if (GpuCount() < 2) GTEST_SKIP() << "needs 2 GPUs; found " << GpuCount();
  testing::TempDir dir;
  auto d = testing::Daemon::Start(dir.path(), {});
  ASSERT_TRUE(d.ok()) << d.status();
  std::vector<std::unique_ptr<testing::Subprocess>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<testing::Subprocess>(
        std::vector<std::string>{COMM_RANK_PATH, "--coordinator", (*d)->address(), "--job", "gpu", "--rank",
                                 std::to_string(r), "--world-size", "2", "--group-size", "2", "--comm", "world",
                                 "--backend", "nccl", "--device", std::to_string(r), "--iterations", "20"},
        dir.File(absl::StrCat("r", r, ".out")), dir.File(absl::StrCat("r", r, ".err"))));
  }
  for (int r = 0; r < 2; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " hung";
    EXPECT_EQ(*code, 0) << testing::ReadFile(dir.File(absl::StrCat("r", r, ".err")));
    EXPECT_THAT(testing::ReadFile(dir.File(absl::StrCat("r", r, ".out"))), ::testing::HasSubstr("iteration 19 epoch 1 ok"));
  }
}

}  // namespace
}  // namespace shardcoord
