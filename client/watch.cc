#include "watch.h"

#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <iostream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::client {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<bool> g_resized{false};
void OnStopSignal(int) { g_stop = true; }
void OnResize(int) { g_resized = true; }

// SGR parameters (ECMA-48) of the styles used; empty: none.
constexpr char kPlain[] = "";
constexpr char kBold[] = "1";
constexpr char kDim[] = "2";
constexpr char kReverse[] = "7";
constexpr char kRed[] = "1;31";
constexpr char kGreen[] = "32";
constexpr char kYellow[] = "33";
constexpr char kCyan[] = "36";

// A piece of a line in one style. Lines are kept as spans until they are written, so that a
// cut at the terminal's width counts only visible columns and never splits an escape sequence.
struct Span {
  std::string text;
  const char* sgr = kPlain;
};
using Line = std::vector<Span>;

Line PlainLine(std::string text) { return {{std::move(text), kPlain}}; }

// Columns a character starting with `lead` takes: two from U+1000 up (wide East Asian
// characters and emoji). Over-counting the narrow ones there keeps a line inside the terminal.
int CharColumns(unsigned char lead) { return lead >= 0xE1 ? 2 : 1; }
bool IsContinuation(unsigned char c) { return (c & 0xC0) == 0x80; }

int Columns(absl::string_view text) {
  int cols = 0;
  for (unsigned char c : text) {
    if (!IsContinuation(c)) cols += CharColumns(c);
  }
  return cols;
}

// The longest prefix of `text` of at most `cols` columns, cut between characters.
std::string CutColumns(absl::string_view text, int cols) {
  int used = 0;
  size_t i = 0;
  while (i < text.size()) {
    const int w = CharColumns(static_cast<unsigned char>(text[i]));
    if (used + w > cols) break;
    used += w;
    for (++i; i < text.size() && IsContinuation(static_cast<unsigned char>(text[i])); ++i) {
    }
  }
  return std::string(text.substr(0, i));
}

// `line` as terminal text cut at `width` columns (0: no limit); with colour, each styled span
// is wrapped in its SGR sequence and a reset.
std::string Emit(const Line& line, int width, bool color) {
  std::string out;
  int left = width > 0 ? width : INT_MAX;
  for (const Span& s : line) {
    if (left <= 0) break;
    const std::string text = Columns(s.text) > left ? CutColumns(s.text, left) : s.text;
    left -= Columns(text);
    if (color && *s.sgr != '\0' && !text.empty()) {
      absl::StrAppend(&out, "\x1b[", s.sgr, "m", text, "\x1b[0m");
    } else {
      out += text;
    }
  }
  return out;
}

struct Cell {
  std::string text;
  const char* sgr = kPlain;
};
struct Column {
  const char* header;
  int min_width;
  bool right;  // Numbers are right-aligned.
};

// Columns of a table cell but the last: a longer one is cut and ends in "...".
constexpr int kMaxCell = 32;

std::string FitCell(const std::string& text) {
  return Columns(text) <= kMaxCell ? text : CutColumns(text, kMaxCell - 3) + "...";
}

// Rows as lines, each column as wide as its widest cell (or header, or `min_width`), so that a
// long job id or state name never shifts the columns after it.
std::vector<Line> Table(const std::vector<Column>& cols, std::vector<std::vector<Cell>> rows, int indent,
                        bool header) {
  if (header) {
    std::vector<Cell> names;
    for (const Column& c : cols) names.push_back({c.header, kBold});
    rows.insert(rows.begin(), std::move(names));
  }
  std::vector<int> widths;
  for (const Column& c : cols) widths.push_back(c.min_width);
  for (auto& row : rows) {
    for (size_t k = 0; k < row.size(); ++k) {
      if (k + 1 < row.size()) row[k].text = FitCell(row[k].text);
      widths[k] = std::max(widths[k], Columns(row[k].text));
    }
  }
  std::vector<Line> out;
  for (const auto& row : rows) {
    Line line = {{std::string(indent, ' '), kPlain}};
    for (size_t k = 0; k < row.size(); ++k) {
      const bool last = k + 1 == row.size();
      const std::string pad(cols[k].right || !last ? widths[k] - Columns(row[k].text) : 0, ' ');
      if (k > 0) line.push_back({" ", kPlain});
      if (cols[k].right) line.push_back({pad, kPlain});
      line.push_back({row[k].text, row[k].sgr});
      if (!cols[k].right) line.push_back({pad, kPlain});
    }
    out.push_back(std::move(line));
  }
  return out;
}

const char* StateColor(const std::string& state) {
  if (state == "live" || state == "healthy") return kGreen;
  if (state == "dead") return kRed;
  if (state == "failed" || state == "recovering") return kYellow;
  if (state == "forming" || state == "unregistered") return kCyan;
  if (state == "left" || state == "finished") return kDim;
  return kPlain;
}

// "2 dead", in the state's colour when there are any.
Span Count(int n, const char* state) { return {absl::StrCat(n, " ", state), n > 0 ? StateColor(state) : kPlain}; }

// "JOB id  ranks 2 live 1 dead  groups 0 healthy 1 failed  decided 8": the live ranks and
// healthy groups always, the other states when there are any (the line fits 80 columns).
Line JobLine(const v1::JobStatus& j) {
  Line l = {{"JOB " + Printable(j.job_id()), kBold}, {"  ranks "}, Count(j.ranks_live(), "live")};
  for (const auto& [n, state] : {std::pair<int, const char*>{j.ranks_dead(), "dead"},
                                 {j.ranks_left(), "left"}, {j.ranks_unregistered(), "unregistered"}}) {
    if (n > 0) l.insert(l.end(), {{" "}, Count(n, state)});
  }
  l.insert(l.end(), {{"  groups "}, Count(j.groups_healthy(), "healthy")});
  for (const auto& [n, state] : {std::pair<int, const char*>{j.groups_failed(), "failed"},
                                 {j.groups_recovering(), "recovering"}, {j.groups_forming(), "forming"},
                                 {j.groups_finished(), "finished"}}) {
    if (n > 0) l.insert(l.end(), {{" "}, Count(n, state)});
  }
  l.push_back({absl::StrCat("  decided ", j.microbatches_decided())});
  return l;
}

// The group table's columns: its own, then a count per kind (decisions.def).
std::vector<Column> GroupColumns() {
  static const std::vector<std::string> kHeaders = [] {
    std::vector<std::string> h;
    for (Decision d : kDecisions) h.push_back(absl::AsciiStrToUpper(DecisionName(d)));
    return h;
  }();
  std::vector<Column> cols = {{"GROUP", 6, false}, {"STATE", 10, false}, {"EPOCH", 6, true}, {"PENDING", 8, true}};
  for (const std::string& h : kHeaders) cols.push_back({h.c_str(), std::max(6, static_cast<int>(h.size()) + 1), true});
  return cols;
}

std::vector<Line> GroupRows(const WatchFrame& f, const std::string& job) {
  std::vector<std::vector<Cell>> rows;
  for (const auto& g : f.groups.groups()) {
    if (g.job_id() != job) continue;
    const std::string state = StateName(g.state());
    const auto& c = g.counts();
    std::vector<Cell> row = {{absl::StrCat(g.group())}, {state, StateColor(state)}, {absl::StrCat(g.epoch())},
                             {absl::StrCat(g.pending_microbatches())}};
    for (Decision d : kDecisions) row.push_back({absl::StrCat(CountOf(c, d))});
    rows.push_back(std::move(row));
  }
  return Table(GroupColumns(), std::move(rows), 2, true);
}

// Sorted by state: what needs attention first.
int StateOrder(v1::RankState s) {
  switch (s) {
    case v1::RANK_STATE_DEAD: return 0;
    case v1::RANK_STATE_UNREGISTERED: return 1;
    case v1::RANK_STATE_LIVE: return 2;
    case v1::RANK_STATE_LEFT: return 3;
    default: return 4;
  }
}

// The sort key first (stalest heartbeat, fewest plans: the rank holding the group back), then
// the rank.
bool RankBefore(const v1::RankStatus& a, const v1::RankStatus& b, RankSort sort) {
  switch (sort) {
    case RankSort::kState:
      if (StateOrder(a.state()) != StateOrder(b.state())) return StateOrder(a.state()) < StateOrder(b.state());
      break;
    case RankSort::kHeartbeatAge:
      if (a.last_heartbeat_age_ms() != b.last_heartbeat_age_ms()) {
        return a.last_heartbeat_age_ms() > b.last_heartbeat_age_ms();
      }
      break;
    case RankSort::kPlans:
      if (a.plans_received() != b.plans_received()) return a.plans_received() < b.plans_received();
      break;
    case RankSort::kRank:
      break;
  }
  return a.rank() < b.rank();
}

const char* SortName(RankSort sort) {
  switch (sort) {
    case RankSort::kRank: return "rank";
    case RankSort::kState: return "state (dead first)";
    case RankSort::kHeartbeatAge: return "heartbeat age (oldest first)";
    case RankSort::kPlans: return "plans (fewest first)";
  }
  return "rank";
}

std::vector<Line> RankRows(const WatchFrame& f, const std::string& job, RankSort sort) {
  std::vector<const v1::RankStatus*> ranks;
  for (const auto& r : f.ranks.ranks()) {
    if (r.job_id() == job) ranks.push_back(&r);
  }
  std::sort(ranks.begin(), ranks.end(), [sort](auto* a, auto* b) { return RankBefore(*a, *b, sort); });
  std::vector<std::vector<Cell>> rows;
  for (const v1::RankStatus* r : ranks) {
    const std::string state = StateName(r->state());
    // A rank that left or died sends no heartbeat: its age is not counted on.
    const int64_t age = r->state() == v1::RANK_STATE_LIVE ? r->last_heartbeat_age_ms() : -1;
    rows.push_back({{absl::StrCat(r->rank())}, {absl::StrCat(r->group())}, {state, StateColor(state)},
                    {age < 0 ? "-" : absl::StrCat(age)}, {absl::StrCat(r->plans_received())},
                    {Printable(r->dead_reason())}});
  }
  return Table({{"RANK", 6, false}, {"GROUP", 6, false}, {"STATE", 8, false}, {"HB_AGE_MS", 10, true},
                {"PLANS", 8, true}, {"WHY DEAD", 0, false}},
               std::move(rows), 2, true);
}

// One line each: "JOB id  finished  2 left  0 dead  decided 8".
std::vector<Line> FinishedRows(const std::vector<const v1::JobStatus*>& jobs) {
  std::vector<std::vector<Cell>> rows;
  for (const v1::JobStatus* j : jobs) {
    const bool dead = j->ranks_dead() > 0;
    rows.push_back({{"JOB " + Printable(j->job_id()), kDim}, {dead ? "failed" : "finished", dead ? kRed : kDim},
                    {absl::StrCat(j->ranks_left(), " left"), kDim},
                    {absl::StrCat(j->ranks_dead(), " dead"), dead ? kRed : kDim},
                    {absl::StrCat("decided ", j->microbatches_decided()), kDim}});
  }
  return Table({{"", 0, false}, {"", 0, false}, {"", 0, true}, {"", 0, true}, {"", 0, false}}, std::move(rows), 0,
               false);
}

// The jobs to show, those matching the filter, live ones first (each kind in the
// coordinator's order).
std::vector<const v1::JobStatus*> OrderedJobs(const v1::StatusResponse& s, const std::string& filter) {
  std::vector<const v1::JobStatus*> out;
  for (bool over : {false, true}) {
    for (const auto& j : s.jobs()) {
      if (JobIsOver(j) == over && absl::StartsWith(j.job_id(), filter)) out.push_back(&j);
    }
  }
  return out;
}

void Append(std::vector<Line> lines, std::vector<Line>* to) {
  to->insert(to->end(), std::make_move_iterator(lines.begin()), std::make_move_iterator(lines.end()));
}

// Every job shown in full, but finished ones a line each at the end when `collapse`.
std::vector<Line> Body(const WatchFrame& f, const WatchView& view, bool collapse) {
  std::vector<Line> body;
  std::vector<const v1::JobStatus*> over;
  const std::vector<const v1::JobStatus*> jobs = OrderedJobs(f.status, view.job_filter);
  for (const v1::JobStatus* j : jobs) {
    if (collapse && JobIsOver(*j)) {
      over.push_back(j);
      continue;
    }
    body.push_back({});
    body.push_back(JobLine(*j));
    Append(GroupRows(f, j->job_id()), &body);
    Append(RankRows(f, j->job_id(), view.sort), &body);
  }
  if (!over.empty()) {
    body.push_back({});
    body.push_back({{"ended jobs, failed or finished (f and a job id show one in full)", kDim}});
    Append(FinishedRows(over), &body);
  }
  if (jobs.empty() && f.error.empty()) {
    body.push_back(PlainLine(view.job_filter.empty() ? "no job yet"
                                                     : absl::StrCat("no job id starts with '", Printable(view.job_filter),
                                                                    "' (Esc clears the filter)")));
  }
  return body;
}

std::vector<Line> HelpLines() {
  std::vector<Line> out = {{{"shardctl watch: the coordinator's jobs, groups and ranks, refreshed", kBold}}, {}};
  for (const char* text : {
           "  q, Ctrl-C          quit",
           "  h, ?               this help (h, ? or Esc closes it)",
           "  s                  sort the rank tables: rank, state (dead first),",
           "                     heartbeat age (oldest first), plans (fewest first)",
           "  f, /               filter by job: type a job id prefix, Enter applies,",
           "                     Esc clears (a finished job matched is shown in full)",
           "  Esc                clear the filter",
           "  up, down, j, k     scroll a line",
           "  PgUp, PgDn, space  scroll a page",
           "  Home, End, g, G    top, bottom",
           "  r                  refresh now",
           "",
           "Live jobs come first; a finished job is one line. Colours: live and healthy",
           "green, dead red, failed and recovering yellow, forming and unregistered cyan,",
           "left and finished dim; NO_COLOR=1 turns them off.",
       }) {
    out.push_back(PlainLine(text));
  }
  return out;
}

// "1h2m3s"; "0s", where absl writes "0".
std::string Uptime(int64_t ms) {
  return ms < 1000 ? "0s" : absl::FormatDuration(absl::Seconds(ms / 1000));
}

// What matters first, as a cut at the terminal's width takes the end.
Line HeaderLine(const WatchFrame& f, const std::string& address) {
  int live = 0;
  for (const auto& j : f.status.jobs()) live += JobIsOver(j) ? 0 : 1;
  return {{"shardcoord " + Printable(address), kBold},
          {absl::StrFormat("  jobs %d (%d live)  %s  version %s  up %s  incarnation %d", f.status.jobs_size(), live,
                           absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone()),
                           Printable(f.status.version()), Uptime(f.status.uptime_ms()), f.status.incarnation())}};
}

Line StatusLine(const WatchView& v, int total, int rows) {
  if (v.help) return {{"keys", kBold}, {"  (rows 1-" + absl::StrCat(std::min(total, rows), " of ", total, ")")}};
  const int first = total == 0 ? 0 : v.scroll + 1;
  const int last = std::min(total, v.scroll + rows);
  return {{"sort: "}, {SortName(v.sort), kBold}, {"  filter: "},
          v.job_filter.empty() ? Span{"all jobs"} : Span{"job id " + Printable(v.job_filter) + "*", kBold},
          {absl::StrFormat("  rows %d-%d of %d", first, last, total)}};
}

// The bottom line in reverse video across the terminal: the keys, or the filter being typed.
Line KeyLine(const WatchView& v, int width) {
  std::string text = v.editing_filter
                         ? "filter: job id starts with: " + Printable(v.filter_input) + "_   Enter applies, Esc clears"
                         : "q quit  h help  s sort  f filter  arrows j k PgUp PgDn scroll  r refresh";
  text = CutColumns(text, width);
  text.append(static_cast<size_t>(std::max(0, width - Columns(text))), ' ');
  return {{text, kReverse}};
}

// The keys as they come: a character, or the escape sequence an arrow or page key sends
// (CSI or SS3 form); a lone ESC is the Escape key.
enum class KeyKind { kChar, kUp, kDown, kPageUp, kPageDown, kHome, kEnd, kEscape, kEnter, kBackspace, kOther };
struct Key {
  KeyKind kind;
  char c = 0;
};

Key NextKey(const std::string& b, size_t* at) {
  const char c = b[(*at)++];
  if (c == '\r' || c == '\n') return {KeyKind::kEnter};
  if (c == 0x7f || c == 0x08) return {KeyKind::kBackspace};
  if (c != 0x1b) return {KeyKind::kChar, c};
  if (*at >= b.size() || (b[*at] != '[' && b[*at] != 'O')) return {KeyKind::kEscape};
  ++*at;
  std::string param;
  while (*at < b.size() && (absl::ascii_isdigit(static_cast<unsigned char>(b[*at])) || b[*at] == ';')) {
    param += b[(*at)++];
  }
  if (*at >= b.size()) return {KeyKind::kOther};
  switch (b[(*at)++]) {
    case 'A': return {KeyKind::kUp};
    case 'B': return {KeyKind::kDown};
    case 'H': return {KeyKind::kHome};
    case 'F': return {KeyKind::kEnd};
    case '~':
      if (param == "5") return {KeyKind::kPageUp};
      if (param == "6") return {KeyKind::kPageDown};
      if (param == "1" || param == "7") return {KeyKind::kHome};
      if (param == "4" || param == "8") return {KeyKind::kEnd};
      return {KeyKind::kOther};
    default: return {KeyKind::kOther};
  }
}

// Moves the body by `lines`; the render clamps the bottom, as only it knows the body's length.
WatchAction Scroll(WatchView* v, int64_t lines) {
  v->scroll = static_cast<int>(std::clamp<int64_t>(int64_t{v->scroll} + lines, 0, INT_MAX / 2));
  return WatchAction::kRedraw;
}

WatchAction MoveKey(KeyKind kind, WatchView* v) {
  switch (kind) {
    case KeyKind::kUp: return Scroll(v, -1);
    case KeyKind::kDown: return Scroll(v, 1);
    case KeyKind::kPageUp: return Scroll(v, -v->page);
    case KeyKind::kPageDown: return Scroll(v, v->page);
    case KeyKind::kHome: return Scroll(v, INT_MIN);
    case KeyKind::kEnd: return Scroll(v, INT_MAX);
    default: return WatchAction::kNone;
  }
}

WatchAction CommandKey(const Key& k, WatchView* v) {
  if (k.kind == KeyKind::kEscape) {
    if (v->help) {
      v->help = false;
    } else {
      v->job_filter.clear();
      v->scroll = 0;
    }
    return WatchAction::kRedraw;
  }
  if (k.kind != KeyKind::kChar) return MoveKey(k.kind, v);
  switch (k.c) {
    case 'q': case 'Q': case 3: return WatchAction::kQuit;
    case 'h': case 'H': case '?': v->help = !v->help; return WatchAction::kRedraw;
    case 's': case 'S':
      v->sort = static_cast<RankSort>((static_cast<int>(v->sort) + 1) % 4);
      return WatchAction::kRedraw;
    case 'f': case 'F': case '/':
      v->editing_filter = true;
      v->help = false;
      v->filter_input.clear();  // A new prefix each time (Enter on nothing shows every job).
      return WatchAction::kRedraw;
    case 'j': return MoveKey(KeyKind::kDown, v);
    case 'k': return MoveKey(KeyKind::kUp, v);
    case ' ': return MoveKey(KeyKind::kPageDown, v);
    case 'g': return MoveKey(KeyKind::kHome, v);
    case 'G': return MoveKey(KeyKind::kEnd, v);
    case 'r': case 'R': return WatchAction::kRefresh;
    case 0x0c: return WatchAction::kRedraw;  // Ctrl-L, as in every full-screen program.
    default: return WatchAction::kNone;
  }
}

// Job ids are anything a trainer chose, so any byte but controls can be typed.
constexpr size_t kMaxFilter = 256;

WatchAction FilterKey(const Key& k, WatchView* v) {
  switch (k.kind) {
    case KeyKind::kEnter:
    case KeyKind::kEscape:
      v->job_filter = k.kind == KeyKind::kEnter ? v->filter_input : "";
      v->editing_filter = false;
      v->scroll = 0;
      return WatchAction::kRedraw;
    case KeyKind::kBackspace:
      while (!v->filter_input.empty() && IsContinuation(static_cast<unsigned char>(v->filter_input.back()))) {
        v->filter_input.pop_back();
      }
      if (!v->filter_input.empty()) v->filter_input.pop_back();
      return WatchAction::kRedraw;
    case KeyKind::kChar:
      if (k.c == 3) return WatchAction::kQuit;
      if (static_cast<unsigned char>(k.c) < 0x20 || v->filter_input.size() >= kMaxFilter) return WatchAction::kNone;
      v->filter_input += k.c;
      return WatchAction::kRedraw;
    default: return WatchAction::kNone;
  }
}

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
      // No Ctrl-Z: a suspended watch would leave the shell in raw mode on the alternate screen.
      raw.c_cc[VSUSP] = _POSIX_VDISABLE;
      restore_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    std::cout << "\x1b[?1049h\x1b[?25l" << std::flush;  // Alternate screen, cursor hidden.
  }
  ~Screen() {
    if (restore_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
    std::cout << "\x1b[?25h\x1b[?1049l" << std::flush;
  }
  // The terminal's size; 80x24 when it does not say.
  static void Size(int* width, int* height) {
    winsize ws{};
    const bool known = ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0;
    *width = known ? ws.ws_col : 80;
    *height = known ? ws.ws_row : 24;
  }

 private:
  termios saved_{};
  bool restore_ = false;
};

// Waits until `deadline` for bytes on stdin (when *keys), a stop signal or a resize; returns
// the bytes read. A stdin at its end, or failing, is not read again.
std::string WaitForInput(absl::Time deadline, bool* keys) {
  while (!g_stop && !g_resized) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return "";
    const int ms = static_cast<int>(std::min<int64_t>(left, 200));  // Signals are seen within 200 ms.
    pollfd p{STDIN_FILENO, POLLIN, 0};
    const int n = *keys ? poll(&p, 1, ms) : poll(nullptr, 0, ms);
    if (n <= 0 || (p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
    char buf[256];
    const ssize_t got = read(STDIN_FILENO, buf, sizeof(buf));
    if (got > 0) return std::string(buf, static_cast<size_t>(got));
    if (got == 0 || (errno != EINTR && errno != EAGAIN)) *keys = false;
  }
  return "";
}

void Draw(const WatchFrame& frame, const std::string& address, WatchView* view) {
  int width = 0, height = 0;
  Screen::Size(&width, &height);
  // Home, the frame (each line clears its own rest), then clear below: no blank flash.
  std::cout << "\x1b[H" << RenderWatchScreen(frame, address, width, height, view) << "\x1b[J" << std::flush;
}

// Colour unless $NO_COLOR is set and not empty (no-color.org).
bool ColorWanted() {
  const char* no_color = std::getenv("NO_COLOR");
  return no_color == nullptr || *no_color == '\0';
}

int RunScreen(const std::function<WatchFrame()>& fetch, const std::string& address, absl::Duration interval,
              int count) {
  Screen screen;
  bool keys = isatty(STDIN_FILENO);
  WatchView view;
  view.color = ColorWanted();
  WatchFrame frame = fetch();
  int frames = 1;
  absl::Time next = absl::Now() + interval;
  Draw(frame, address, &view);
  while (!g_stop && (count == 0 || frames < count)) {
    const std::string input = WaitForInput(next, &keys);
    g_resized = false;
    const WatchAction action = input.empty() ? WatchAction::kNone : ApplyWatchKeys(input, &view);
    if (g_stop || action == WatchAction::kQuit) break;
    if (action == WatchAction::kRefresh || absl::Now() >= next) {
      frame = fetch();
      ++frames;
      next = absl::Now() + interval;
    }
    Draw(frame, address, &view);  // After a key, a resize or a fetch.
  }
  return 0;
}

}  // namespace

std::string RenderWatchScreen(const WatchFrame& f, const std::string& address, int width, int height,
                              WatchView* view) {
  width = std::max(width, 1);
  height = std::max(height, 1);
  std::vector<Line> screen = {HeaderLine(f, address)};
  if (!f.error.empty()) screen.push_back({{"!! " + Printable(f.error), kRed}});
  // A filter shows the finished jobs it matches in full: the way to look into one.
  const std::vector<Line> body = view->help ? HelpLines() : Body(f, *view, view->job_filter.empty());
  // The status line and the key line are fixed; the body scrolls in the rows left.
  const int rows = std::max(0, height - static_cast<int>(screen.size()) - 2);
  const int total = static_cast<int>(body.size());
  view->page = std::max(1, rows);
  view->scroll = std::clamp(view->scroll, 0, std::max(0, total - rows));
  screen.push_back(StatusLine(*view, total, rows));
  for (int i = view->scroll; i < std::min(total, view->scroll + rows); ++i) screen.push_back(body[i]);
  // On a terminal of a row or two, the key line stays and the top goes.
  if (static_cast<int>(screen.size()) > height - 1) screen.resize(height - 1);
  std::string out;
  for (const Line& l : screen) absl::StrAppend(&out, Emit(l, width, view->color), "\x1b[K\n");
  return out + Emit(KeyLine(*view, width), width, view->color);
}

std::string RenderWatchPlain(const WatchFrame& f, const std::string& address) {
  std::vector<Line> lines = {HeaderLine(f, address)};
  if (!f.error.empty()) lines.push_back(PlainLine("!! " + Printable(f.error)));
  Append(Body(f, WatchView{}, /*collapse=*/false), &lines);
  std::string out;
  for (const Line& l : lines) absl::StrAppend(&out, Emit(l, 0, false), "\n");
  return out;
}

WatchAction ApplyWatchKeys(const std::string& bytes, WatchView* view) {
  WatchAction result = WatchAction::kNone;
  for (size_t at = 0; at < bytes.size();) {
    const Key key = NextKey(bytes, &at);
    const WatchAction a = view->editing_filter ? FilterKey(key, view) : CommandKey(key, view);
    if (a == WatchAction::kQuit) return a;
    result = std::max(result, a);
  }
  return result;
}

int RunWatch(const std::function<WatchFrame()>& fetch, const std::string& address, absl::Duration interval,
             int count) {
  g_stop = false;
  g_resized = false;
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  // Every signal that would end the process ends the loop instead, so the terminal is restored.
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaction(sig, &sa, nullptr);
  // No SA_RESTART: a resize interrupts the wait and redraws at once.
  struct sigaction winch {};
  winch.sa_handler = OnResize;
  sigaction(SIGWINCH, &winch, nullptr);
  if (isatty(STDOUT_FILENO)) return RunScreen(fetch, address, interval, count);
  bool keys = false;  // Plain frames: no keys, one frame per interval.
  for (int n = 0; (count == 0 || n < count) && !g_stop; ++n) {
    std::cout << RenderWatchPlain(fetch(), address) << "\n" << std::flush;
    if (count != 0 && n + 1 == count) break;
    const absl::Time next = absl::Now() + interval;
    while (!g_stop && absl::Now() < next) {
      WaitForInput(next, &keys);
      g_resized = false;
    }
  }
  return 0;
}

}  // namespace shardcoord::client
