// The daemon's state as Prometheus metrics (text format 0.0.4, written by prometheus-cpp), for
// GET /metrics (http_server.h). Named by Prometheus conventions: prefix `shardcoord_`, base
// units, `_total` for counters, `shardcoord_build_info`; labels by job, group, state and
// decision kind, never by step, microbatch or rank (the series stay few per job).
#ifndef SHARDCOORD_COORDINATOR_METRICS_H_
#define SHARDCOORD_COORDINATOR_METRICS_H_

#include <string>

#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

// What the metrics are made of: one snapshot of the core's queries.
struct Snapshot {
  v1::StatusResponse status;
  v1::ListGroupsResponse groups;
  v1::ListRanksResponse ranks;
  v1::ListCommsResponse comms;
};

std::string MetricsText(const Snapshot& snapshot);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_METRICS_H_
