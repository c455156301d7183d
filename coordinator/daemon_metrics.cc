#include "coordinator/daemon_metrics.h"

#include <utility>

namespace shardcoord::coordinator {
namespace {

using prometheus::MetricFamily;
using prometheus::MetricType;

// Plan-to-decision waits are sub-millisecond when ranks plan in step and reach minutes when a
// rank stalls (plan_timeout_ms is 300 s).
const prometheus::Histogram::BucketBoundaries kLatencyBuckets = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
// Death detection is bounded by heartbeat_timeout_ms (5 s by default); recovery by
// recovery_window_ms (60 s).
const prometheus::Histogram::BucketBoundaries kSecondsBuckets = {
    0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300};

MetricFamily Single(const std::string& name, const std::string& help, const prometheus::Histogram& h) {
  return MetricFamily{name, help, MetricType::Histogram, {h.Collect()}};
}

}  // namespace

DaemonMetrics::DaemonMetrics()
    : decision_latency_(kLatencyBuckets), death_detection_(kSecondsBuckets), group_recovery_(kSecondsBuckets) {
  absl::MutexLock lock(&mu_);
  for (const char* kind : kEventKinds) events_.emplace(kind, std::make_unique<prometheus::Counter>());
}

void DaemonMetrics::CountEvent(const std::string& kind) {
  absl::MutexLock lock(&mu_);
  auto& counter = events_[kind];
  if (!counter) counter = std::make_unique<prometheus::Counter>();
  counter->Increment();
}

void DaemonMetrics::AppendTo(std::vector<MetricFamily>* out) const {
  MetricFamily events{"shardcoord_events_total", "Events recorded in the journal, by kind (shardctl events)",
                      MetricType::Counter, {}};
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [kind, counter] : events_) {
      prometheus::ClientMetric m = counter->Collect();
      m.label = {{"kind", kind}};
      events.metric.push_back(std::move(m));
    }
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
