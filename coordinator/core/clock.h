// Time source of the coordinator, a seam for tests (a fake clock steps time by hand).
#ifndef SHARDCOORD_COORDINATOR_CORE_CLOCK_H_
#define SHARDCOORD_COORDINATOR_CORE_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardcoord::coordinator {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_CLOCK_H_
