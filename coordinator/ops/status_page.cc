#include "coordinator/ops/status_page.h"

#include <algorithm>
#include <cctype>
#include <iterator>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

constexpr char kStyle[] = R"(
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:20px}h2{font-size:17px;margin-top:1.6em}h3{font-size:15px}
table{border-collapse:collapse;margin:.4em 0}td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f4f4f4}.dead td{background:#fdd}.behind td{background:#ffe9b3}.failed td{background:#fdd}
.muted{color:#777}.chart text{font-size:11px}
p.finished{margin:.3em 0}.ended-dead{color:#b00}
)";

std::string Cell(const std::string& text) { return "<td>" + HtmlEscape(text) + "</td>"; }

std::string Header(const v1::StatusResponse& s, int refresh) {
  return absl::StrCat(
      "<h1>shardcoord coordinator</h1><p class=muted>", HtmlEscape(s.listen_address()), " &middot; version ",
      HtmlEscape(s.version()), " &middot; up ", absl::FormatDuration(absl::Seconds(s.uptime_ms() / 1000)), s.uptime_ms() < 1000 ? "s" : "",
      " &middot; incarnation ", s.incarnation(), " &middot; ", s.jobs_size(), s.jobs_size() == 1 ? " job" : " jobs", " &middot; refreshes every ",
      refresh, " s</p>");
}

std::string Chart(const std::deque<DecisionSample>& h) {
  const int w = 600, ht = 120;
  int64_t top = 1;
  for (const auto& p : h) {
    for (int64_t v : p.by_kind) top = std::max(top, v);
  }
  const double t0 = h.empty() ? 0 : h.front().unix_ms;
  const double span = h.empty() ? 1 : std::max<double>(1, h.back().unix_ms - t0);
  std::string out = absl::StrFormat(
      "<svg class=chart id=decisions-chart width=%d height=%d role=img aria-label='module decisions over time'>"
      "<rect width=%d height=%d fill=#fafafa stroke=#ddd />",
      w + 110, ht + 20, w, ht);
  for (size_t k = 0; k < kNumDecisions; ++k) {  // A series per kind (decisions.def).
    const char* colour = DecisionColour(kDecisions[k]);
    std::vector<std::string> pts;
    for (const auto& p : h) {
      const int64_t v = p.by_kind[k];
      pts.push_back(absl::StrFormat("%.1f,%.1f", (p.unix_ms - t0) / span * w, ht - double(v) / top * (ht - 4)));
    }
    out += absl::StrFormat("<polyline fill=none stroke='%s' stroke-width=2 points='%s'/>", colour,
                           absl::StrJoin(pts, " "));
    out += absl::StrFormat("<text x=%d y=%d fill='%s'>%s</text>", w + 8, 14 + 16 * int(k), colour,
                           DecisionName(kDecisions[k]));
  }
  return absl::StrCat(out, absl::StrFormat("<text x=4 y=14>%d</text><text x=4 y=%d>0</text></svg>", top, ht - 4),
                      "<p class=muted>module decisions given, all jobs, cumulative</p>");
}

// Rows of one table on the page, at most: the page stays small whatever the job's size.
constexpr size_t kPageRows = 256;
constexpr int kFullJobs = 8;  // Live jobs shown at full size on the page of every job.

// "0,1,2,...": at most 32 ranks, then how many more (a group of 16,384 ranks in one cell).
std::string ShortRanks(const google::protobuf::RepeatedField<int32_t>& ranks) {
  constexpr int kShown = 32;
  if (ranks.size() <= kShown) return absl::StrJoin(ranks, ",");
  return absl::StrCat(absl::StrJoin(ranks.begin(), ranks.begin() + kShown, ","), ",... (", ranks.size() - kShown,
                      " more)");
}

std::string GroupTable(const std::string& job, const v1::ListGroupsResponse& groups) {
  std::string out = "<table class=groups><tr><th>group<th>ranks<th>state<th>epoch<th>pending";
  for (Decision d : kDecisions) absl::StrAppend(&out, "<th>", DecisionName(d));
  out += "<th>divergent<th>why failed</tr>";
  // At most kPageRows groups a job, the failed ones first.
  std::vector<const v1::GroupStatus*> rows, others;
  for (const auto& g : groups.groups()) {
    if (g.job_id() == job) (g.state() == v1::GROUP_STATE_FAILED ? rows : others).push_back(&g);
  }
  rows.insert(rows.end(), others.begin(), others.end());
  const size_t shown = std::min(rows.size(), kPageRows);
  for (size_t i = 0; i < shown; ++i) {
    const v1::GroupStatus& g = *rows[i];
    const std::string state = StateName(g.state());
    const auto& c = g.counts();
    out += absl::StrCat("<tr class='group ", state == "failed" ? "failed" : "", "' data-group=", g.group(), ">",
                        Cell(std::to_string(g.group())), Cell(ShortRanks(g.ranks())), Cell(state),
                        Cell(std::to_string(g.epoch())), Cell(std::to_string(g.pending_microbatches())));
    for (Decision d : kDecisions) out += Cell(std::to_string(CountOf(c, d)));
    out += absl::StrCat(Cell(std::to_string(c.divergent())), Cell(g.failure_reason()), "</tr>");
  }
  out += "</table>";
  if (rows.size() > shown) {
    out += absl::StrCat("<p class=muted>", rows.size() - shown, " more groups not shown (the failed come first): "
                        "shardctl groups --job ", HtmlEscape(job), "</p>");
  }
  return out;
}

std::string RankTable(const std::string& job, const PageInput& in, const std::set<std::pair<std::string, int>>& behind) {
  std::string out =
      "<table class=ranks><tr><th>rank<th>group<th>state<th>host<th>heartbeat age<th>plans<th>pending<th>why dead"
      "</tr>";
  // At most kPageRows ranks a job: the dead and the behind first, then the rest in rank order
  // (65,536 ranks made an 11.7 MB page); `shardctl ranks --job` lists them all.
  struct Row {
    const v1::RankStatus* r;
    bool is_behind;
  };
  std::vector<Row> attention, others;
  for (const auto& r : in.snapshot.ranks.ranks()) {
    if (r.job_id() != job) continue;
    const bool late = r.state() == v1::RANK_STATE_LIVE && r.last_heartbeat_age_ms() > 2 * in.heartbeat_interval_ms;
    const bool is_behind = late || behind.count({job, r.rank()}) > 0;
    (r.state() == v1::RANK_STATE_DEAD || is_behind ? attention : others).push_back({&r, is_behind});
  }
  attention.insert(attention.end(), others.begin(), others.end());
  const size_t shown = std::min(attention.size(), kPageRows);
  for (size_t i = 0; i < shown; ++i) {
    const v1::RankStatus& r = *attention[i].r;
    const bool is_behind = attention[i].is_behind;
    const std::string state = StateName(r.state());
    const std::string cls = state == "dead" ? "dead" : is_behind ? "behind" : "";
    const std::string age = r.last_heartbeat_age_ms() < 0 ? "-" : absl::StrCat(r.last_heartbeat_age_ms(), " ms");
    out += absl::StrCat("<tr class='rank ", cls, "' data-rank=", r.rank(), " data-state=", state, ">",
                        Cell(std::to_string(r.rank())), Cell(std::to_string(r.group())),
                        Cell(is_behind ? state + " (behind)" : state), Cell(r.host()), Cell(age),
                        Cell(std::to_string(r.plans_received())), Cell(std::to_string(r.pending_plans())),
                        Cell(r.dead_reason()), "</tr>");
  }
  out += "</table>";
  if (attention.size() > shown) {
    out += absl::StrCat("<p class=muted>", attention.size() - shown, " more ranks not shown (the dead and the behind "
                        "come first): shardctl ranks --job ", HtmlEscape(job), "</p>");
  }
  return out;
}

std::string CommTable(const std::string& job, const v1::ListCommsResponse& comms) {
  std::string out = "<table class=comms><tr><th>communicator<th>epoch<th>state<th>ranks<th>behind / why aborted</tr>";
  for (const auto& c : comms.comms()) {
    if (c.job_id() != job) continue;
    out += absl::StrCat("<tr>", Cell(c.name()), Cell(std::to_string(c.epoch())),
                        Cell(StateName(c.state())), Cell(absl::StrJoin(c.ranks(), ",")),
                        Cell(c.behind().empty() ? c.abort_reason() : c.behind()), "</tr>");
  }
  return out + "</table>";
}

std::string Events(const std::vector<v1::Event>& events) {
  std::string out =
      "<h2>Latest events</h2><table class=events><tr><th>time (UTC)<th>severity<th>kind<th>job<th>rank<th>group"
      "<th>message</tr>";
  for (const auto& e : events) {
    out += absl::StrCat(
        "<tr>", Cell(absl::FormatTime("%H:%M:%E3S", absl::FromUnixMillis(e.unix_ms()), absl::UTCTimeZone())),
        Cell(e.severity()), Cell(e.kind()), Cell(e.job_id()), Cell(e.rank() >= 0 ? std::to_string(e.rank()) : ""),
        Cell(e.group() >= 0 ? std::to_string(e.group()) : ""), Cell(e.message()), "</tr>");
  }
  return out + "</table>";
}

bool HasComms(const std::string& job, const v1::ListCommsResponse& comms) {
  for (const auto& c : comms.comms()) {
    if (c.job_id() == job) return true;
  }
  return false;
}

// The summary line, groups, ranks and communicators of one job.
std::string JobBody(const v1::JobStatus& j, const PageInput& in, const std::set<std::pair<std::string, int>>& behind) {
  const Snapshot& s = in.snapshot;
  const std::string& job = j.job_id();
  return absl::StrCat("<p>", j.world_size(), " ranks: ", j.ranks_live(), " live, ", j.ranks_dead(), " dead, ",
                      j.ranks_left(), " left, ", j.ranks_unregistered(), " not registered &middot; ",
                      j.microbatches_decided(), " microbatches decided</p>", "<h3>Shard groups</h3>",
                      GroupTable(job, s.groups), "<h3>Ranks</h3>", RankTable(job, in, behind),
                      "<h3>Communicators</h3>", HasComms(job, s.comms) ? CommTable(job, s.comms)
                                                                      : "<p class=muted>none opened by this job</p>");
}

// One line for a job that is over, linking to its own page (/?job=ID) where its tables are in
// full: a <details> here would close again at every refresh.
std::string FinishedJob(const v1::JobStatus& j) {
  const std::string ended = j.ranks_dead() > 0
                                ? absl::StrCat("<span class=ended-dead>ended: ", j.ranks_dead(), " dead</span>, ",
                                               j.ranks_left(), " left")
                                : absl::StrCat("finished: ", j.ranks_left(), " left");
  return absl::StrCat("<p class=finished data-job='", HtmlEscape(j.job_id()), "'><a href='/?job=",
                      UrlEncode(j.job_id()), "'><b>Job ", HtmlEscape(j.job_id()), "</b></a> &middot; ", ended,
                      " &middot; ", j.microbatches_decided(), " microbatches decided</p>");
}

// A live job past the ones shown at full size: one line linking to its own page.
std::string LiveJobLine(const v1::JobStatus& j) {
  return absl::StrCat("<p class=live-line data-job='", HtmlEscape(j.job_id()), "'><a href='/?job=",
                      UrlEncode(j.job_id()), "'><b>Job ", HtmlEscape(j.job_id()), "</b></a> &middot; ",
                      j.ranks_live(), " of ", j.world_size(), " ranks live", j.ranks_dead() > 0 ?
                      absl::StrCat(", <span class=ended-dead>", j.ranks_dead(), " dead</span>") : "",
                      " &middot; ", j.microbatches_decided(), " microbatches decided</p>");
}

}  // namespace

std::string UrlEncode(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += absl::StrFormat("%%%02X", c);
    }
  }
  return out;
}

std::string UrlDecode(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    int hi = 0, lo = 0;
    if (text[i] == '%' && i + 2 < text.size() && (hi = HexValue(text[i + 1])) >= 0 &&
        (lo = HexValue(text[i + 2])) >= 0) {
      out += static_cast<char>(hi * 16 + lo);
      i += 2;
    } else {
      out += text[i] == '+' ? ' ' : text[i];
    }
  }
  return out;
}

std::string HtmlEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string StatusPage(const PageInput& in) {
  const Snapshot& s = in.snapshot;
  // (job, rank) behind in a communicator: while one is flagged, its members that issued the
  // fewest collectives.
  std::set<std::pair<std::string, int>> behind;
  for (const auto& c : s.comms.comms()) {
    if (c.behind().empty() || c.members().empty()) continue;
    int64_t least = c.members(0).issued();
    for (const auto& m : c.members()) least = std::min(least, m.issued());
    for (const auto& m : c.members()) {
      if (m.issued() == least) behind.insert({c.job_id(), m.rank()});
    }
  }
  std::string out = absl::StrCat("<!doctype html><html><head><meta charset=utf-8><title>shardcoord</title>",
                                 "<meta http-equiv=refresh content=", in.refresh_seconds, "><style>", kStyle,
                                 "</style></head><body>", Header(s.status, in.refresh_seconds),
                                 // The chart counts every job's decisions: on the page of one job it is not shown.
                                 in.job.empty() ? Chart(in.history) : std::string());
  // Live jobs first, at full size; a finished one (hours of them on a shared daemon) is one
  // line linking to its own page, so it never pushes a running job down the page.
  // The page is bounded per page, not only per job (200 live jobs made a 16 MB page): the first
  // kFullJobs live jobs at full size, the other live ones a line each, linking to their pages.
  std::string finished, more;
  int full = 0;
  if (!in.job.empty() && in.link_every_job) out += "<p><a href='/'>&larr; every job</a></p>";
  for (const auto& j : s.status.jobs()) {
    if (JobIsOver(j) && in.job.empty()) {
      finished += FinishedJob(j);
    } else if (in.job.empty() && full >= kFullJobs) {
      more += LiveJobLine(j);
    } else {
      ++full;
      out += absl::StrCat("<section class=job data-job='", HtmlEscape(j.job_id()), "'><h2>Job ",
                          HtmlEscape(j.job_id()), "</h2>", JobBody(j, in, behind), "</section>");
    }
  }
  if (!more.empty()) out += absl::StrCat("<h2>More live jobs</h2>", more);
  if (!finished.empty()) out += "<h2>Finished jobs</h2>" + finished;
  if (s.status.jobs_size() == 0) {
    out += in.job.empty() ? "<p>No job yet.</p>" : absl::StrCat("<p>No job '", HtmlEscape(in.job), "' here.</p>");
  }
  return out + Events(in.events) + "</body></html>";
}

}  // namespace shardcoord::coordinator
