#include "coordinator/event_journal.h"

#include <algorithm>


namespace shardcoord::coordinator {

void EventJournal::Add(absl::Time when, const std::string& severity, const std::string& kind,
                       const std::string& job_id, int rank, int group,
                       const std::string& message) {
  absl::MutexLock lock(&mu_);
  v1::Event e;
  e.set_id(next_id_++);
  e.set_unix_ms(absl::ToUnixMillis(when));
  e.set_severity(severity);
  e.set_kind(kind);
  e.set_job_id(job_id);
  e.set_rank(rank);
  e.set_group(group);
  e.set_message(message);
  events_.push_back(std::move(e));
  while (static_cast<int>(events_.size()) > capacity_) events_.pop_front();
}

std::vector<v1::Event> EventJournal::List(const std::string& job_id, uint64_t after_id,
                                          int limit) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Event> out;
  if (after_id == 0) {
    // No cursor: the most recent `limit` events, oldest first.
    for (auto it = events_.rbegin(); it != events_.rend() && static_cast<int>(out.size()) < limit; ++it) {
      if (job_id.empty() || it->job_id() == job_id) out.push_back(*it);
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
  for (const auto& e : events_) {
    if (e.id() <= after_id) continue;
    if (!job_id.empty() && e.job_id() != job_id) continue;
    out.push_back(e);
    if (static_cast<int>(out.size()) >= limit) break;
  }
  return out;
}

}  // namespace shardcoord::coordinator
