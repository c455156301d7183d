// Invariants of the core's state: a failed one is a bug in shardcoord. It is said once, as
// an internal error naming what broke, in the daemon's log; tests fail on it
// (InvariantFailures); the daemon goes on, refusing only what the broken state concerns,
// instead of clamping the state back into range and hiding the bug.
#ifndef SHARDCOORD_COORDINATOR_CORE_INVARIANT_H_
#define SHARDCOORD_COORDINATOR_CORE_INVARIANT_H_

#include <cstdint>
#include <string>

namespace shardcoord::coordinator {

// Logs "internal error: <what>" (with the file and line) and counts it. Returns false.
bool InvariantFailed(const char* file, int line, const std::string& what);
// How many invariants failed in this process (tests assert 0).
int64_t InvariantFailures();

}  // namespace shardcoord::coordinator

// True when `cond` holds; else reports the failure. `what` is built only then.
#define SHARDCOORD_INVARIANT(cond, what) \
  (static_cast<bool>(cond) || ::shardcoord::coordinator::InvariantFailed(__FILE__, __LINE__, (what)))

#endif  // SHARDCOORD_COORDINATOR_CORE_INVARIANT_H_
