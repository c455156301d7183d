// `shardctl watch`: a live view of the coordinator that redraws in place, like top. On a
// terminal it takes the alternate screen and quits on `q` or Ctrl-C; when output is not a
// terminal it prints plain frames (no escape sequences), one per interval.
#ifndef SHARDCOORD_CLIENT_WATCH_H_
#define SHARDCOORD_CLIENT_WATCH_H_

#include <functional>
#include <ostream>
#include <string>

#include "absl/time/time.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::client {

struct WatchFrame {
  v1::StatusResponse status;
  v1::ListGroupsResponse groups;
  v1::ListRanksResponse ranks;
  std::string error;  // Set when the coordinator could not be read this time.
};

// One frame as lines, each cut to `width` columns, at most `height` lines (0: no limit).
// Every string from the coordinator is printed with control characters escaped.
std::string RenderWatch(const WatchFrame& frame, const std::string& address, int width, int height);

// Calls `fetch` every `interval` and shows the frame; stops after `count` frames (0: until
// `q`, Ctrl-C or SIGTERM). Returns the exit code (0).
int RunWatch(const std::function<WatchFrame()>& fetch, const std::string& address, absl::Duration interval,
             int count);

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_WATCH_H_
