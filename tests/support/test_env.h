// Small helpers for tests: temporary directories and deadline-bounded waiting.
#ifndef SHARDCOORD_TESTS_SUPPORT_TEST_ENV_H_
#define SHARDCOORD_TESTS_SUPPORT_TEST_ENV_H_

#include <functional>
#include <string>

#include "absl/time/time.h"

namespace shardcoord::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Evaluates `cond` until it is true or `timeout` passes; returns its last value. For
// conditions observed from outside (a file appearing, a status reported over RPC).
bool WaitUntil(const std::function<bool()>& cond, absl::Duration timeout,
               absl::Duration poll = absl::Milliseconds(20));

std::string ReadFile(const std::string& path);

}  // namespace shardcoord::testing

#endif  // SHARDCOORD_TESTS_SUPPORT_TEST_ENV_H_
