#include "coordinator/core/daemon_metrics.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace shardcoord::coordinator {
namespace {

using prometheus::MetricFamily;
using prometheus::MetricType;

// Plan-to-decision waits are sub-millisecond when ranks plan in step and reach minutes when a
// rank stalls (plan_timeout_ms is 300 s).
const std::vector<double> kLatencyBuckets = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
// Death detection is bounded by heartbeat_timeout_ms (5 s by default); recovery by
// recovery_window_ms (60 s).
const std::vector<double> kSecondsBuckets = {
    0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300};

MetricFamily Single(const std::string& name, const std::string& help, const AtomicHistogram& h) {
  return MetricFamily{name, help, MetricType::Histogram, {h.Collect()}};
}

}  // namespace

AtomicHistogram::AtomicHistogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void AtomicHistogram::Observe(absl::Duration d) {
  if (d < absl::ZeroDuration()) d = absl::ZeroDuration();  // A clock step back: not a negative wait.
  const double seconds = absl::ToDoubleSeconds(d);
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), seconds) - bounds_.begin();
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(absl::ToInt64Nanoseconds(d), std::memory_order_relaxed);
}

prometheus::ClientMetric AtomicHistogram::Collect() const {
  prometheus::ClientMetric m;
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    m.histogram.bucket.push_back(
        {cumulative, i < bounds_.size() ? bounds_[i] : std::numeric_limits<double>::infinity()});
  }
  m.histogram.sample_count = cumulative;
  m.histogram.sample_sum = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9;
  return m;
}

DaemonMetrics::DaemonMetrics()
    : decision_latency_(kLatencyBuckets), death_detection_(kSecondsBuckets), group_recovery_(kSecondsBuckets) {}

void DaemonMetrics::AppendTo(std::vector<MetricFamily>* out) const {
  MetricFamily events{"shardcoord_events_total", "Events recorded in the journal, by kind (shardctl events)",
                      MetricType::Counter, {}};
  for (size_t i = 0; i < kEventKindCount; ++i) {
    prometheus::ClientMetric m = events_[i].Collect();
    m.label = {{"kind", kEventKindNames[i]}};
    events.metric.push_back(std::move(m));
  }
  out->push_back(std::move(events));
  out->push_back(Single("shardcoord_decision_latency_seconds",
                        "From the first plan of a microbatch reaching its group to the group's decision", decision_latency_));
  out->push_back(Single("shardcoord_rank_death_detection_seconds",
                        "From a rank's last message to the daemon declaring it dead", death_detection_));
  out->push_back(Single("shardcoord_group_recovery_seconds",
                        "From the daemon's start to a group recovered after a restart", group_recovery_));
}

}  // namespace shardcoord::coordinator
