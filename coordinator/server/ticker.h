// The coordinator's clock-driven work (DESIGN 9): a thread that calls CoordinatorCore::Tick
// (heartbeat and plan deadlines) every period, and OnPaused when the gap since the previous
// tick shows the daemon itself was not running (stopped, swapped out, a debugger), so that a
// paused daemon does not declare every rank dead. Owned by whoever runs the core.
//
// A second thread gives the heap's free memory back to the system every 10 s (glibc's
// malloc_trim): buffers freed after a burst (ranks that stopped reading, a large resume, a
// flood of bad requests) otherwise stay in the daemon's RSS, 79 MB against 25 MB after three
// rounds of non-reading ranks (docs/RELIABILITY.md).
#ifndef SHARDCOORD_COORDINATOR_SERVER_TICKER_H_
#define SHARDCOORD_COORDINATOR_SERVER_TICKER_H_

#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/core/coordinator_core.h"

namespace shardcoord::coordinator {

class Ticker {
 public:
  // Period: half the heartbeat interval, within 5..100 ms; a gap over half the heartbeat
  // timeout is a pause.
  explicit Ticker(CoordinatorCore* core);
  ~Ticker() { Stop(); }
  Ticker(const Ticker&) = delete;
  Ticker& operator=(const Ticker&) = delete;

  void Start();
  void Stop();  // Returns once the thread has ended. Idempotent.

 private:
  void Loop();
  void TrimLoop();

  CoordinatorCore* const core_;
  const absl::Duration period_;
  const absl::Duration pause_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
  std::thread trim_thread_;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SERVER_TICKER_H_
