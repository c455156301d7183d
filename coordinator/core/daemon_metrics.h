// DaemonMetrics: the counters and histograms the core feeds as things happen, for GET
// /metrics (metrics.h computes the rest from a snapshot of the core's state at scrape time).
// Daemon-wide, without a job label: they live as long as the process, so rates and alerts
// over them never lose a series when a job is forgotten. Thread-safe: prometheus-cpp's Counter
// is atomic, and the histograms are lock-free
// (prometheus-cpp's Histogram takes one mutex per observation, which would serialize every
// group's decisions again, DESIGN 9).
#ifndef SHARDCOORD_COORDINATOR_CORE_DAEMON_METRICS_H_
#define SHARDCOORD_COORDINATOR_CORE_DAEMON_METRICS_H_

#include <prometheus/client_metric.h>
#include <prometheus/counter.h>
#include <prometheus/metric_family.h>

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/journal/event_kind.h"

namespace shardcoord::coordinator {

// A Prometheus histogram with fixed bounds, observed without a lock: a relaxed atomic add per
// bucket and for the sum (in nanoseconds). A scrape may see one observation in the count and
// not yet in the sum; Prometheus tolerates that.
class AtomicHistogram {
 public:
  explicit AtomicHistogram(std::vector<double> bounds);
  void Observe(absl::Duration d);
  prometheus::ClientMetric Collect() const;

 private:
  const std::vector<double> bounds_;  // Seconds, ascending; +Inf implied.
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // Not cumulative; one more than bounds_.
  std::atomic<int64_t> sum_ns_{0};
};

class DaemonMetrics {
 public:
  DaemonMetrics();

  DaemonMetrics(const DaemonMetrics&) = delete;
  DaemonMetrics& operator=(const DaemonMetrics&) = delete;

  // Every kind (event_kind.h) has its counter from the start, at zero, so that
  // `increase(shardcoord_events_total{kind="rank_dead"}[5m])` has data before the first death.
  void CountEvent(EventKind kind) { events_[static_cast<size_t>(kind)].Increment(); }
  // From the first plan of a microbatch reaching its group to the group's decision (dynamic
  // policies): how long the slowest member's plan kept the others' decision waiting.
  void ObserveDecisionLatency(absl::Duration d) { decision_latency_.Observe(d); }
  // From a rank's last message to the daemon declaring it dead (heartbeat timeout, lost
  // stream, cut): how long its group ran on without knowing.
  void ObserveDeathDetection(absl::Duration d) { death_detection_.Observe(d); }
  // From the daemon's start to a group recovered after a restart (DESIGN 12).
  void ObserveGroupRecovery(absl::Duration d) { group_recovery_.Observe(d); }

  // shardcoord_events_total and the histograms, as metric families.
  void AppendTo(std::vector<prometheus::MetricFamily>* out) const;

 private:
  std::array<prometheus::Counter, kEventKindCount> events_;
  AtomicHistogram decision_latency_;
  AtomicHistogram death_detection_;
  AtomicHistogram group_recovery_;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_DAEMON_METRICS_H_
