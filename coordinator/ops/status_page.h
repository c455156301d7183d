// The HTML status page (GET / on the daemon's HTTP listener, http_server.h): jobs, shard
// groups with state and epoch, ranks with heartbeat age (behind and dead ones marked),
// decisions per kind over time as a small SVG chart, communicators and the latest events.
// Rendered by the daemon, self-contained (no script, no CDN) and refreshing itself.
#ifndef SHARDCOORD_COORDINATOR_OPS_STATUS_PAGE_H_
#define SHARDCOORD_COORDINATOR_OPS_STATUS_PAGE_H_

#include <cstdint>
#include <array>
#include <deque>
#include <string>
#include <vector>

#include "coordinator/ops/metrics.h"
#include "shardcoord/types.h"

namespace shardcoord::coordinator {

// Module decisions of every job, summed, at one time (the chart's points).
struct DecisionSample {
  int64_t unix_ms = 0;
  std::array<int64_t, kNumDecisions> by_kind{};  // In decisions.def order (kDecisions).
};

struct PageInput {
  Snapshot snapshot;
  std::vector<v1::Event> events;        // Latest first.
  std::deque<DecisionSample> history;   // Oldest first.
  int64_t heartbeat_interval_ms = 500;  // A live rank silent for 2 intervals is marked behind.
  int refresh_seconds = 2;
  std::string job;  // The page of one job (/?job=ID): that job in full, finished or not.
  bool link_every_job = true;  // On a job's page, a link back to every job (not for a reader of one job).
};

std::string StatusPage(const PageInput& in);

// `text` with & < > " ' written as entities (every client-chosen string on the page).
std::string HtmlEscape(const std::string& text);

// For a URL's query: `text` percent-encoded (all but letters, digits and - _ . ~), and back
// (a malformed escape is kept as it is; '+' is a space).
std::string UrlEncode(const std::string& text);
std::string UrlDecode(const std::string& text);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_OPS_STATUS_PAGE_H_
