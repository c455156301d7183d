// `shardctl watch`: a live view of the coordinator that redraws in place, like top. On a
// terminal it takes the alternate screen, colours states (unless $NO_COLOR is set), shows its
// keys on the bottom line and reads them (help, sort, filter by job, scroll, refresh, quit);
// live jobs come first and a finished job is one line. When output is not a terminal it
// prints plain frames (no escape sequences, every job in full), one per interval.
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

// The order of the rank tables; `s` goes to the next one.
enum class RankSort { kRank, kState, kHeartbeatAge, kPlans };

// What the operator chose with keys; it outlives the frames fetched.
struct WatchView {
  RankSort sort = RankSort::kRank;
  std::string job_filter;  // Only jobs whose id starts with this; empty: every job.
  bool editing_filter = false;
  std::string filter_input;  // Typed after `f` or `/`, until Enter.
  bool help = false;
  int scroll = 0;  // The first body line shown.
  int page = 1;    // Body rows of the last frame drawn: PgUp and PgDn move by this.
  bool color = false;
};

// One frame for a terminal of `width` x `height`: at most `height` rows, the last one the key
// line (with no newline after it), none wider than `width` columns once escape sequences are
// left out; colour when view->color. Every string from the coordinator is printed with
// control characters escaped. Clamps view->scroll to the body and sets view->page.
std::string RenderWatchScreen(const WatchFrame& frame, const std::string& address, int width, int height,
                              WatchView* view);

// One plain frame (output is not a terminal): every job in full, live ones first, no escape
// sequences and no cuts.
std::string RenderWatchPlain(const WatchFrame& frame, const std::string& address);

enum class WatchAction { kNone, kRedraw, kRefresh, kQuit };

// Applies the bytes read from the terminal (keys, and the escape sequences of the arrow and
// page keys) to `view`; says what the loop does next.
WatchAction ApplyWatchKeys(const std::string& bytes, WatchView* view);

// Calls `fetch` every `interval` (and on `r`) and shows the frame; stops after `count` frames
// (0: until `q`, Ctrl-C or SIGTERM). Returns the exit code (0).
int RunWatch(const std::function<WatchFrame()>& fetch, const std::string& address, absl::Duration interval,
             int count);

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_WATCH_H_
