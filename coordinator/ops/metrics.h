// The daemon's state as Prometheus metrics (text format 0.0.4, written by prometheus-cpp), for
// GET /metrics (http_server.h). Named and labelled by Prometheus conventions: prefix
// `shardcoord_`, base units, `_total` for counters, `shardcoord_build_info`, the standard
// `process_*` series; no `job` or `instance` label (Prometheus adds those for the target: a
// shardcoord job is `job_id`). Series per job (labels job_id, module, state, decision) exist
// while the daemon holds the job (job_retention_ms after its last rank ended), with every
// state present at zero; per-rank and per-group series only for jobs of at most
// metrics_rank_series_max ranks; per-module and per-communicator series for the first
// metrics_labels_max (job, module) and (job, communicator) pairs, the rest of a job's summed
// under "_other" (names are the client's: the bound keeps a scrape small); the event counters and histograms (daemon_metrics.h) are
// daemon-wide. The list of series, with their labels, is docs/METRICS.md, checked against a
// real Prometheus by tests/python/test_prometheus.py.
#ifndef SHARDCOORD_COORDINATOR_OPS_METRICS_H_
#define SHARDCOORD_COORDINATOR_OPS_METRICS_H_

#include <cstdint>
#include <string>

#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

class DaemonMetrics;

// What the metrics are made of: one snapshot of the core's queries, and its live counters.
struct Snapshot {
  v1::StatusResponse status;
  v1::ListGroupsResponse groups;
  v1::ListRanksResponse ranks;
  v1::ListCommsResponse comms;
  // The daemon-wide series: event counters, histograms and buffers (they concern every job).
  // Absent for a reader limited to one job (a token with job=ID), and then `process` too.
  const DaemonMetrics* daemon = nullptr;
  int64_t buffered_bytes = 0;  // Charged to max_buffered_bytes now.
  int64_t buffered_bytes_limit = 0;
  int rank_series_max = 0;  // metrics_rank_series_max: per-rank and per-group series up to it.
  int labels_max = 4096;    // metrics_labels_max: (job, module) and (job, communicator) pairs.
  bool process = false;     // Add the process_* series (this process's descriptors, memory, CPU).
};

std::string MetricsText(const Snapshot& snapshot);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_OPS_METRICS_H_
