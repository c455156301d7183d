#include "support/test_env.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "absl/time/clock.h"

namespace shardcoord::testing {

TempDir::TempDir() {
  const char* base = getenv("TMPDIR");
  std::string tmpl = std::string(base ? base : "/tmp") + "/shardcoord-test.XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

bool WaitUntil(const std::function<bool()>& cond, absl::Duration timeout, absl::Duration poll) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (cond()) return true;
    if (absl::Now() >= deadline) return cond();
    absl::SleepFor(poll);
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace shardcoord::testing
