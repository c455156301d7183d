// EventJournal: a bounded, in-memory journal of what happened (registrations, deaths,
// group failures, promotions), served by `shardctl events`
// (the core writes each event's log line itself, outside its lock).
// Thread-safe.
#ifndef SHARDCOORD_COORDINATOR_EVENT_JOURNAL_H_
#define SHARDCOORD_COORDINATOR_EVENT_JOURNAL_H_

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

class EventJournal {
 public:
  explicit EventJournal(int capacity) : capacity_(capacity) {}

  // Records an event; severity is "info", "warning" or "error". rank/group -1 = none.
  void Add(absl::Time when, const std::string& severity, const std::string& kind,
           const std::string& job_id, int rank, int group, const std::string& message);

  // Events of `job_id` (empty: all) with id > after_id, oldest first, at most `limit`;
  // with after_id 0, the most recent `limit` events.
  std::vector<v1::Event> List(const std::string& job_id, uint64_t after_id, int limit) const;

 private:
  const int capacity_;
  mutable absl::Mutex mu_;
  std::deque<v1::Event> events_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_EVENT_JOURNAL_H_
