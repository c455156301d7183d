#include "coordinator/journal/event_journal.h"

#include <algorithm>

#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {
namespace {

constexpr absl::Duration kWriteInterval = absl::Milliseconds(100);
constexpr absl::Duration kPruneInterval = absl::Minutes(10);

}  // namespace

EventJournal::~EventJournal() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (writer_.joinable()) writer_.join();
}

absl::Status EventJournal::Persist(const std::string& path, absl::Duration retention, int64_t max_events) {
  auto store = JournalStore::Open(path);
  if (!store.ok()) return store.status();
  retention_ = retention;
  max_events_ = max_events;
  // The highest id before pruning: ids go on increasing even when every old event is pruned,
  // so that a reader's `after_id` cursor stays valid across the restart.
  const uint64_t max_id = (*store)->MaxId();
  const int64_t pruned = (*store)->Prune(absl::Now(), retention, max_events);
  EventFilter newest;
  newest.limit = capacity_;
  std::vector<v1::Event> loaded = (*store)->Query(newest);
  {
    absl::MutexLock store_lock(&store_mu_);
    absl::MutexLock lock(&mu_);
    // Events added before (none in the daemon) are renumbered after the file's.
    for (auto& e : events_) e.set_id(max_id + e.id());
    for (auto& e : unwritten_) e.set_id(max_id + e.id());
    next_id_ += max_id;
    written_through_ = max_id;
    events_.insert(events_.begin(), loaded.begin(), loaded.end());
    while (static_cast<int>(events_.size()) > capacity_) events_.pop_front();
    store_ = *std::move(store);
    persistent_ = true;
  }
  logging::Get("coordinator")
      ->info("journal file={} events={} pruned={} retention_hours={} max_events={}", path, max_id, pruned,
             absl::ToInt64Hours(retention), max_events);
  writer_ = std::thread([this] { WriterLoop(); });
  return absl::OkStatus();
}

void EventJournal::Add(absl::Time when, Severity severity, EventKind kind, const std::string& job_id, int rank,
                       int group, const std::string& message) {
  absl::MutexLock lock(&mu_);
  v1::Event e;
  e.set_id(next_id_++);
  e.set_unix_ms(absl::ToUnixMillis(when));
  e.set_severity(SeverityName(severity));
  e.set_kind(EventKindName(kind));
  e.set_job_id(job_id);
  e.set_rank(rank);
  e.set_group(group);
  e.set_message(message);
  if (persistent_) {
    unwritten_.push_back(e);
    if (unwritten_.size() > kMaxUnwrittenEvents) {
      unwritten_.pop_front();
      dropped_++;
    }
  }
  events_.push_back(std::move(e));
  while (static_cast<int>(events_.size()) > capacity_) events_.pop_front();
}

void EventJournal::WriterLoop() {
  absl::Time next_prune = absl::Now() + kPruneInterval;
  while (true) {
    bool stop = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !unwritten_.empty(); };
      mu_.AwaitWithTimeout(absl::Condition(&ready), kWriteInterval);
      stop = stopping_;
    }
    // The batch leaves `unwritten_` and enters the file under store_mu_, so that List sees
    // every event in one of the two.
    absl::MutexLock store_lock(&store_mu_);
    std::vector<v1::Event> batch;
    uint64_t dropped = 0;
    {
      absl::MutexLock lock(&mu_);
      batch.assign(unwritten_.begin(), unwritten_.end());
      unwritten_.clear();
      std::swap(dropped, dropped_);
    }
    if (dropped > 0) {
      logging::Get("coordinator")->warn("journal: {} events were not written: the disk was too slow", dropped);
    }
    bool failed = false;
    if (!batch.empty()) {
      if (absl::Status s = store_->Append(batch); !s.ok()) {
        failed = true;
        // Kept for the next round (within the queue's bound), so a busy or full disk loses
        // only what the bound drops, counted.
        int64_t held_back = 0;
        if (write_errors_.Allow(&held_back)) {
          logging::Get("coordinator")
              ->warn("journal: {} events not written yet: {} ({} more such errors)", batch.size(),
                     std::string(s.message()), held_back);
        }
        absl::MutexLock lock(&mu_);
        unwritten_.insert(unwritten_.begin(), batch.begin(), batch.end());
        while (unwritten_.size() > kMaxUnwrittenEvents) {
          unwritten_.pop_front();
          dropped_++;
        }
      } else {
        absl::MutexLock lock(&mu_);
        written_through_ = batch.back().id();
      }
    }
    if (absl::Now() >= next_prune) {
      store_->Prune(absl::Now(), retention_, max_events_);
      next_prune = absl::Now() + kPruneInterval;
    }
    if (stop && (batch.empty() || failed)) return;  // Stopping: one more try, not a loop.
  }
}

void EventJournal::Flush() {
  absl::MutexLock lock(&mu_);
  if (!writer_.joinable()) return;
  const uint64_t target = next_id_ - 1;
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_through_ >= target || stopping_; };
  mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(10));
}

bool EventJournal::Matches(const v1::Event& e, const EventFilter& f) {
  return (f.job_id.empty() || e.job_id() == f.job_id) && (f.kind.empty() || e.kind() == f.kind) &&
         e.unix_ms() >= f.since_unix_ms && e.id() > f.after_id;
}

std::vector<v1::Event> EventJournal::List(const EventFilter& f) const {
  const int limit = std::max(0, f.limit);
  std::vector<v1::Event> out;
  absl::MutexLock store_lock(&store_mu_);
  // The SQLite query runs under store_mu_ alone: Add (called under the core's lock by every
  // event of every job) takes only mu_, so a slow reader of a large journal never stalls it.
  // Holding store_mu_ keeps the writer from moving events into the file meanwhile.
  const bool persistent = store_ != nullptr;
  if (persistent) out = store_->Query(f);
  absl::MutexLock lock(&mu_);
  if (persistent) {
    // Then what the writer has not written yet (all newer).
    for (const auto& e : unwritten_) {
      if (e.id() > written_through_ && Matches(e, f)) out.push_back(e);
    }
  } else {
    for (const auto& e : events_) {
      if (Matches(e, f)) out.push_back(e);
    }
  }
  if (static_cast<int>(out.size()) > limit) {
    // No cursor: the most recent `limit`; after one: the first `limit`.
    if (f.after_id == 0) {
      out.erase(out.begin(), out.end() - limit);
    } else {
      out.resize(limit);
    }
  }
  return out;
}

}  // namespace shardcoord::coordinator
