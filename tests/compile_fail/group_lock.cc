// The per-group lock rule (DESIGN 9), checked by the compiler: a shard group's state is
// reachable only through its GroupSlot, whose mutex guards it (ABSL_GUARDED_BY). The clang
// build (SHARDCOORD_THREAD_SAFETY) compiles this file twice: as it is, where every access
// holds the mutex (it must compile), and with SHARDCOORD_TOUCH_WITHOUT_LOCK, where one
// function touches the group without it (the ctest compile_fail.group_lock passes only when
// that build fails with clang's "requires holding mutex" error).
#include "absl/synchronization/mutex.h"
#include "coordinator/core/shard_group.h"

namespace shardcoord::coordinator {

void TrimHistoryWithTheLock(GroupSlot& slot) {
  GroupLock lock(&slot.mu);
  slot.group.TrimHistory(0);
}

int LiveMembersWithTheLock(const GroupSlot& slot) {
  GroupLock lock(&slot.mu);
  return slot.group.Count().live;
}

#ifdef SHARDCOORD_TOUCH_WITHOUT_LOCK
// What the hot path must never do: change a group's state holding only the core's lock (or
// nothing), while another thread holds the group's mutex. (Its fields are private: the group
// is changed through its operations only.)
void TrimHistoryWithoutTheLock(GroupSlot& slot) { slot.group.TrimHistory(0); }
#endif

}  // namespace shardcoord::coordinator
