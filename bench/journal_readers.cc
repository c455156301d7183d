// journal_readers: do `shardctl events` readers stall the daemon's event writers? (a
// benchmark, not a test; issue 25 item 6).
//
// Every event of every job is added to the journal under the core's lock, so an Add that
// waits for a reader's SQLite query stalls every job. This fills a journal file with
// --events events, then times --adds Adds (a job's events) alone and beside 2 and 8 reader
// threads that query the whole file in a loop (a kind no event has: a full scan, as
// `shardctl events --kind` of a rare kind). Prints, per case, the Adds' wall
// time and their latency p50 / p99 / max: a writer blocked by a query shows as a max near
// one query's duration. The machine's cores are shared by readers and writer, so compare
// the max, not the wall time.
//
//   journal_readers --events 1000000 --adds 20000
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/journal/event_journal.h"

namespace {

using shardcoord::coordinator::EventFilter;
using shardcoord::coordinator::EventJournal;
using shardcoord::coordinator::EventKind;
using shardcoord::coordinator::Severity;

struct Case {
  double wall_ms, p50_us, p99_us, max_us, query_ms;
  int64_t queries;
};

Case Run(EventJournal& journal, int readers, int adds) {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> queries{0}, query_ns{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < readers; ++i) {
    threads.emplace_back([&] {
      while (!stop.load()) {
        const int64_t t0 = absl::GetCurrentTimeNanos();
        journal.List(EventFilter{"", "no-such-kind", 0, 0, 100});
        query_ns += absl::GetCurrentTimeNanos() - t0;
        queries++;
      }
    });
  }
  if (readers > 0) {
    while (queries.load() < readers) absl::SleepFor(absl::Milliseconds(1));  // Every reader is in.
  }
  std::vector<int64_t> lat(adds);
  const absl::Time start = absl::Now();
  for (int i = 0; i < adds; ++i) {
    const int64_t t0 = absl::GetCurrentTimeNanos();
    journal.Add(absl::Now(), Severity::kInfo, EventKind::kRankRegistered, "job", i % 8, 0, "a job's event");
    lat[i] = absl::GetCurrentTimeNanos() - t0;
  }
  const double wall = absl::ToDoubleMilliseconds(absl::Now() - start);
  stop = true;
  for (auto& t : threads) t.join();
  std::sort(lat.begin(), lat.end());
  auto at = [&](double q) { return lat[std::min<size_t>(lat.size() - 1, static_cast<size_t>(q * lat.size()))] / 1e3; };
  const int64_t q = queries.load();
  return {wall, at(0.5), at(0.99), lat.back() / 1e3, q > 0 ? query_ns.load() / 1e6 / q : 0, q};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t events = 1000000;
  int adds = 20000;
  std::string file = "/tmp/journal_readers.db";
  CLI::App app{"journal_readers: do event queries stall event writers?"};
  app.add_option("--events", events, "events in the journal file before timing");
  app.add_option("--adds", adds, "events added per case");
  app.add_option("--file", file, "journal file (replaced)");
  CLI11_PARSE(app, argc, argv);
  unlink(file.c_str());
  EventJournal journal(10000);
  if (absl::Status s = journal.Persist(file, absl::Hours(24 * 365), events * 2); !s.ok()) {
    std::fprintf(stderr, "journal_readers: %s\n", s.ToString().c_str());
    return 2;
  }
  const absl::Time fill = absl::Now();
  for (int64_t i = 0; i < events; ++i) {
    journal.Add(absl::Now(), Severity::kInfo, EventKind::kRankRegistered, absl::StrCat("old-job-", i % 1000), static_cast<int>(i % 64),
                0, "an old event of an old job");
    if (i % 50000 == 49999) journal.Flush();  // Keep the unwritten queue under its bound.
  }
  journal.Flush();
  std::printf("filled %lld events in %.1f s\n", static_cast<long long>(events),
              absl::ToDoubleSeconds(absl::Now() - fill));
  std::printf("%-8s %10s %10s %10s %12s %12s %8s\n", "readers", "adds_ms", "p50_us", "p99_us", "max_us",
              "query_ms", "queries");
  for (int readers : {0, 2, 8}) {
    const Case c = Run(journal, readers, adds);
    journal.Flush();
    std::printf("%-8d %10.1f %10.1f %10.1f %12.1f %12.1f %8lld\n", readers, c.wall_ms, c.p50_us, c.p99_us, c.max_us,
                c.query_ms, static_cast<long long>(c.queries));
  }
  unlink(file.c_str());
  return 0;
}
