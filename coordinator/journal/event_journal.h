// EventJournal: what happened (registrations, deaths with reasons, group failures and
// re-forms, promotions, communicator aborts), served by `shardctl events` and the status page
// (the core writes each event's log line itself, outside its lock). The newest `capacity`
// events are kept in memory; with a journal file (Persist) every event is also appended to
// SQLite (journal_store.h) by a writer thread, in batches, so that adding never waits for the
// disk and events survive a restart. Thread-safe.
#ifndef SHARDCOORD_COORDINATOR_JOURNAL_EVENT_JOURNAL_H_
#define SHARDCOORD_COORDINATOR_JOURNAL_EVENT_JOURNAL_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/journal/event_kind.h"
#include "coordinator/journal/journal_store.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

// Events queued for the disk at most; past it the oldest queued are dropped, counted and logged.
inline constexpr size_t kMaxUnwrittenEvents = 100000;

class EventJournal {
 public:
  explicit EventJournal(int capacity) : capacity_(capacity) {}
  ~EventJournal();  // Writes what is queued, then stops the writer.

  // Keeps the journal in `path` too: loads its newest events (ids continue after them), prunes
  // it to `retention` and `max_events`, and starts the writer. The error names the file.
  absl::Status Persist(const std::string& path, absl::Duration retention, int64_t max_events);

  // Records an event (its severity and kind by their names on the wire). rank/group -1 = none.
  void Add(absl::Time when, Severity severity, EventKind kind, const std::string& job_id, int rank, int group,
           const std::string& message);

  // Events matching `filter`, oldest first: from the file when there is one (every retained
  // event), else from memory.
  std::vector<v1::Event> List(const EventFilter& filter) const;

  // Waits until every event added so far is in the file (no-op without one).
  void Flush();

 private:
  void WriterLoop();
  static bool Matches(const v1::Event& e, const EventFilter& f);

  const int capacity_;
  mutable absl::Mutex mu_;
  std::deque<v1::Event> events_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<v1::Event> unwritten_ ABSL_GUARDED_BY(mu_);  // Added, not yet handed to the writer.
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t written_through_ ABSL_GUARDED_BY(mu_) = 0;  // Highest id on disk.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool persistent_ ABSL_GUARDED_BY(mu_) = false;  // Persist succeeded: events are queued for the file.
  absl::Duration retention_;
  int64_t max_events_ = 0;
  // The store is used by the writer and by List; its own lock, taken before mu_.
  mutable absl::Mutex store_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::unique_ptr<JournalStore> store_ ABSL_GUARDED_BY(store_mu_);
  std::thread writer_;
  logging::RateLimit write_errors_{1};  // Writer thread only.
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_JOURNAL_EVENT_JOURNAL_H_
