// ExclusiveLock: a lockable type (one with Lock and Unlock, annotated ABSL_LOCKABLE) held
// exclusively for a scope, in a form clang's lock analysis follows (std::lock_guard carries no
// annotations). The core's lock (CoreLock) and a shard group's (GroupLock) use it.
#ifndef SHARDCOORD_COORDINATOR_CORE_SCOPED_LOCK_H_
#define SHARDCOORD_COORDINATOR_CORE_SCOPED_LOCK_H_

#include "absl/base/thread_annotations.h"

namespace shardcoord::coordinator {

template <typename Mutex>
class ABSL_SCOPED_LOCKABLE ExclusiveLock {
 public:
  explicit ExclusiveLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~ExclusiveLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  ExclusiveLock(const ExclusiveLock&) = delete;
  ExclusiveLock& operator=(const ExclusiveLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_SCOPED_LOCK_H_
