#include "watch.h"

#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::client {
namespace {

std::atomic<bool> g_stop{false};
void OnStopSignal(int) { g_stop = true; }

// The terminal in raw mode (keys arrive one by one, not echoed) on the alternate screen, for
// as long as it lives; restored on every way out of RunWatch.
class Screen {
 public:
  Screen() {
    if (tcgetattr(STDIN_FILENO, &saved_) == 0) {
      termios raw = saved_;
      raw.c_lflag &= ~(ICANON | ECHO);
      raw.c_cc[VMIN] = 0;
      raw.c_cc[VTIME] = 0;
      restore_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    std::cout << "\x1b[?1049h\x1b[?25l" << std::flush;  // Alternate screen, cursor hidden.
  }
  ~Screen() {
    if (restore_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
    std::cout << "\x1b[?25h\x1b[?1049l" << std::flush;
  }
  static void Size(int* width, int* height) {
    winsize ws{};
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) {
      *width = ws.ws_col;
      *height = ws.ws_row;
    }
  }

 private:
  termios saved_{};
  bool restore_ = false;
};

// Waits up to `d` for `q` on a terminal's stdin (or a stop signal); true to quit.
bool WaitForQuit(absl::Duration d, bool keys) {
  const absl::Time end = absl::Now() + d;
  while (!g_stop) {
    const int ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(end - absl::Now())));
    pollfd p{STDIN_FILENO, POLLIN, 0};
    const int n = keys ? poll(&p, 1, std::min(ms, 200)) : poll(nullptr, 0, std::min(ms, 200));
    if (n > 0 && (p.revents & POLLIN)) {
      char c = 0;
      if (read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q' || c == 3)) return true;
    }
    if (absl::Now() >= end) return false;
  }
  return true;
}

}  // namespace

std::string RenderWatch(const WatchFrame& f, const std::string& address, int width, int height) {
  std::vector<std::string> lines;
  lines.push_back(absl::StrFormat("shardcoord %s  version %s  up %.0f s  incarnation %d  jobs %d   %s",
                                  Printable(address), Printable(f.status.version()), f.status.uptime_ms() / 1000.0,
                                  f.status.incarnation(), f.status.jobs_size(),
                                  absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone())));
  if (!f.error.empty()) lines.push_back("!! " + Printable(f.error));
  for (const auto& j : f.status.jobs()) {
    lines.push_back("");
    lines.push_back(absl::StrFormat("JOB %s  ranks %d live %d dead %d left  groups %d healthy %d failed  decided %d",
                                    Printable(j.job_id()), j.ranks_live(), j.ranks_dead(), j.ranks_left(),
                                    j.groups_healthy(), j.groups_failed(), j.microbatches_decided()));
    lines.push_back(absl::StrFormat("  %-6s %-10s %6s %8s %10s %6s %6s %10s", "GROUP", "STATE", "EPOCH", "PENDING",
                                    "PER_LAYER", "SKIP", "ROOT", "REPLICATE"));
    for (const auto& g : f.groups.groups()) {
      if (g.job_id() != j.job_id()) continue;
      lines.push_back(absl::StrFormat("  %-6d %-10s %6d %8d %10d %6d %6d %10d", g.group(),
                                      StateName(g.state()), g.epoch(),
                                      g.pending_microbatches(), g.counts().per_layer(), g.counts().skip(),
                                      g.counts().root(), g.counts().replicate()));
    }
    lines.push_back(absl::StrFormat("  %-6s %-6s %-8s %10s %8s  %s", "RANK", "GROUP", "STATE", "HB_AGE_MS", "PLANS",
                                    "WHY DEAD"));
    for (const auto& r : f.ranks.ranks()) {
      if (r.job_id() != j.job_id()) continue;
      lines.push_back(absl::StrFormat("  %-6d %-6d %-8s %10d %8d  %s", r.rank(), r.group(),
                                      StateName(r.state()), r.last_heartbeat_age_ms(),
                                      r.plans_received(), Printable(r.dead_reason())));
    }
  }
  if (f.status.jobs_size() == 0 && f.error.empty()) lines.push_back("no job yet");
  if (height > 1 && static_cast<int>(lines.size()) > height - 1) {
    const size_t more = lines.size() - (height - 2);
    lines.resize(height - 2);
    lines.push_back(absl::StrFormat("... %d more lines (a larger window, or --job)", more));
  }
  std::ostringstream out;
  for (auto& l : lines) {
    if (width > 0 && static_cast<int>(l.size()) > width) l.resize(width);
    out << l << "\n";
  }
  return out.str();
}

int RunWatch(const std::function<WatchFrame()>& fetch, const std::string& address, absl::Duration interval,
             int count) {
  g_stop = false;
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  // Every signal that would end the process ends the loop instead, so the terminal is restored.
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaction(sig, &sa, nullptr);
  const bool terminal = isatty(STDOUT_FILENO);
  std::unique_ptr<Screen> screen;
  if (terminal) screen = std::make_unique<Screen>();
  const bool keys = terminal && isatty(STDIN_FILENO);
  for (int n = 0; (count == 0 || n < count) && !g_stop; ++n) {
    const WatchFrame frame = fetch();
    if (terminal) {
      int width = 0, height = 0;
      Screen::Size(&width, &height);
      std::string text = RenderWatch(frame, address, width, height);
      std::cout << "\x1b[H\x1b[2J" << text << "(q or Ctrl-C quits)" << std::flush;
    } else {
      std::cout << RenderWatch(frame, address, 0, 0) << "\n" << std::flush;
    }
    if (count != 0 && n + 1 == count) break;
    if (WaitForQuit(interval, keys)) break;
  }
  return 0;
}

}  // namespace shardcoord::client
