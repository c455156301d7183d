#include "coordinator/core/invariant.h"

#include <atomic>

#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {
namespace {

std::atomic<int64_t> invariant_failures{0};

}  // namespace

bool InvariantFailed(const char* file, int line, const std::string& what) {
  invariant_failures++;
  static const auto log = logging::Get("coordinator");
  log->error("internal error at {}:{}: {} (a bug in shardcoord: please report it with this log)", file, line,
             what);
  return false;
}

int64_t InvariantFailures() { return invariant_failures.load(); }

}  // namespace shardcoord::coordinator
