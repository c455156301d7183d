// JournalStore: the event journal on disk, in SQLite (`journal_file`), so that an operator
// reads yesterday's events after a daemon restart. One table, appended in batches by the
// journal's writer thread (event_journal.h); pruned by age (`journal_retention_hours`) and
// size (`journal_max_events`). WAL mode: appends never wait for readers. Not thread-safe:
// the journal serializes calls.
#ifndef SHARDCOORD_COORDINATOR_JOURNAL_JOURNAL_STORE_H_
#define SHARDCOORD_COORDINATOR_JOURNAL_JOURNAL_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shardcoord/v1/coordinator.pb.h"

struct sqlite3;

namespace shardcoord::coordinator {

// Which events a query wants; empty or zero fields do not filter.
struct EventFilter {
  std::string job_id;
  std::string kind;
  int64_t since_unix_ms = 0;
  uint64_t after_id = 0;  // 0: the most recent `limit`; else the first `limit` after it.
  int limit = 100;
};

class JournalStore {
 public:
  // Opens or creates the file (mode 600). INVALID_ARGUMENT names the file and why (not a
  // database, another schema, cannot be written) and what to do.
  // Refuses (INVALID_ARGUMENT, naming the file) what is not a shardcoord journal, a damaged
  // file (SQLite's quick_check) and one whose newest id is past kMaxEventId.
  static absl::StatusOr<std::unique_ptr<JournalStore>> Open(const std::string& path);
  static constexpr uint64_t kMaxEventId = uint64_t{1} << 62;
  ~JournalStore();

  absl::Status Append(const std::vector<v1::Event>& events);  // One transaction.
  std::vector<v1::Event> Query(const EventFilter& filter) const;  // Oldest first.
  uint64_t MaxId() const;  // 0 when empty.
  // Deletes events older than `retention` and all but the newest `max_events`; returns how many.
  int64_t Prune(absl::Time now, absl::Duration retention, int64_t max_events);

 private:
  explicit JournalStore(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}
  sqlite3* db_;
  const std::string path_;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_JOURNAL_JOURNAL_STORE_H_
