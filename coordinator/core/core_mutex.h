// CoreMutex: the core's reader/writer mutex, whose holders queue work for after they
// release it (DESIGN 9).
//
// What may block or call back must not run under the core's lock: log lines, the
// completions of waiting communicator calls (which may call into the core again), and the
// start of network writes (RankSink::Kick). A holder queues them (Defer, Kick); whoever
// releases the mutex carries out what its own thread queued, after unlocking: the kicks
// first, then the deferred work, each in the order queued. The queues are per thread,
// since the hot path's holders (shared) run side by side. A deferred completion that calls
// back into the core carries out what it queues in its own scope.
#ifndef SHARDCOORD_COORDINATOR_CORE_CORE_MUTEX_H_
#define SHARDCOORD_COORDINATOR_CORE_CORE_MUTEX_H_

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/rank_sink.h"
#include "coordinator/core/scoped_lock.h"

namespace shardcoord::coordinator {

class ABSL_LOCKABLE CoreMutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.Lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_.Unlock();
    RunDeferred();
  }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.ReaderLock(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() {
    mu_.ReaderUnlock();
    RunDeferred();
  }

  // Work for after this thread releases the mutex: logging, completions.
  void Defer(std::function<void()> f) ABSL_SHARED_LOCKS_REQUIRED(this) {
    ThisThread().deferred.push_back(std::move(f));
  }
  // `sink` was sent to: its write starts after this thread releases the mutex (once per
  // run of sends to it).
  void Kick(const std::shared_ptr<RankSink>& sink) ABSL_SHARED_LOCKS_REQUIRED(this) {
    auto& kick = ThisThread().kick;
    if (kick.empty() || kick.back() != sink) kick.push_back(sink);
  }

 private:
  struct AfterUnlock {
    std::vector<std::function<void()>> deferred;
    std::vector<std::shared_ptr<RankSink>> kick;
  };
  static AfterUnlock& ThisThread() {
    thread_local AfterUnlock after;
    return after;
  }
  static void RunDeferred() {
    AfterUnlock now;
    now.deferred.swap(ThisThread().deferred);
    now.kick.swap(ThisThread().kick);
    for (auto& sink : now.kick) sink->Kick();
    for (auto& f : now.deferred) f();
  }

  absl::Mutex mu_;
};

// Holds a CoreMutex exclusively for a scope.
using CoreLock = ExclusiveLock<CoreMutex>;

// Holds a CoreMutex shared for a scope (the hot path, which then takes a group's mutex; the
// status queries).
class ABSL_SCOPED_LOCKABLE CoreReaderLock {
 public:
  explicit CoreReaderLock(CoreMutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ~CoreReaderLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  CoreReaderLock(const CoreReaderLock&) = delete;
  CoreReaderLock& operator=(const CoreReaderLock&) = delete;

 private:
  CoreMutex* const mu_;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_CORE_MUTEX_H_
