#include "replay.h"

#include <sys/stat.h>

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "json_values.h"
#include "daemon_process.h"
#include "shardcoord/plan_ahead.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/worker.h"

namespace shardcoord::client {
namespace {

struct RankRun {
  int rank = 0;
  int group = 0;
  std::vector<MicrobatchDecision> decisions;
  bool failed = false;
  bool bad_input = false;  // The coordinator refused the registration as invalid.
  std::string failure;
};

// "per_layer=N skip=N ..." for every kind (decisions.def), from counts by name.
std::string KindCounts(std::map<std::string, int64_t>& counts) {
  std::vector<std::string> parts;
  for (Decision d : kDecisions) parts.push_back(absl::StrCat(DecisionName(d), "=", counts[DecisionName(d)]));
  return absl::StrJoin(parts, " ");
}

std::string DescribeModules(const MicrobatchDecision& d) {
  std::vector<std::string> parts;
  for (const auto& m : d.modules) parts.push_back(absl::StrCat(m.module, "=", DecisionName(m.decision)));
  return absl::StrCat("seq ", d.seq, " [", absl::StrJoin(parts, " "), "]");
}

// One output line: {"rank":R (with --per-rank),"group":..,"step":..,"microbatch":..,
// "module":..,"decision":..,"seq":..,"reason":.. and, for padded, "calls":..}.
std::string DecisionLine(int rank, const MicrobatchDecision& d, const ModuleDecision& m) {
  nlohmann::ordered_json j;
  if (rank >= 0) j["rank"] = rank;
  j["group"] = d.group;
  j["step"] = d.key.step;
  j["microbatch"] = d.key.microbatch;
  j["module"] = m.module;
  j["decision"] = DecisionName(m.decision);
  j["seq"] = d.seq;
  j["reason"] = DecisionReasonName(m.reason);
  if (m.decision == Decision::kPadded) j["calls"] = m.calls;  // The passes: part of the decision.
  return j.dump();
}

bool SameDecision(const MicrobatchDecision& a, const MicrobatchDecision& b) {
  if (a.seq != b.seq || a.digest != b.digest || a.modules.size() != b.modules.size()) return false;
  for (size_t i = 0; i < a.modules.size(); ++i) {
    if (a.modules[i].module != b.modules[i].module || a.modules[i].decision != b.modules[i].decision) {
      return false;
    }
  }
  return true;
}

// The ranks start together once every rank's thread exists: when one cannot be created, no
// rank has registered yet, and all return at once. std:: primitives, not absl::Notification:
// waiting on them allocates nothing, and the gate is used when memory ran out.
class StartGate {
 public:
  void Open(bool go) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
      go_ = go;
    }
    cv_.notify_all();
  }
  // Blocks until Open; returns its `go`.
  bool Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return open_; });
    return go_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  bool go_ = false;
};

// The sizes the replay registers.
struct World {
  int size = 0;
  int group_size = 0;
};

WorkerOptions WorkerOptionsFor(const ReplayOptions& o, const std::string& address, const World& world, int rank) {
  WorkerOptions wo;
  wo.coordinator_address = address;
  wo.job_id = o.job_id;
  wo.rank = rank;
  wo.world_size = world.size;
  wo.group_size = world.group_size;
  wo.modules = o.modules;
  wo.policy = o.policy;
  wo.fallback = o.fallback;
  wo.wrap_outer_model = o.wrap_outer_model;
  wo.lookahead = o.lookahead;
  wo.memory_budget_bytes = o.memory_budget_bytes;
  wo.connect_timeout = o.connect_timeout;
  wo.reconnect_window = o.reconnect_window;
  wo.tls = o.tls;
  return wo;
}

// Plays every microbatch of the trace on `worker`, keeping what it received in `run`; stops
// at the first error.
void PlayMicrobatches(const Trace& trace, const ReplayOptions& o, Worker& worker, RankRun* run) {
  const std::vector<MicrobatchKey> keys(trace.keys.begin(), trace.keys.end());
  auto plans_it = trace.plans.find(run->rank);
  PlanAhead ahead(worker, static_cast<int64_t>(keys.size()), [&](int64_t i) {
    MicrobatchPlan plan;
    plan.key = keys[i];
    if (plans_it != trace.plans.end()) {
      auto p = plans_it->second.find(plan.key);
      if (p != plans_it->second.end()) plan.calls = p->second;
    }
    return plan;
  });
  for (size_t i = 0; i < keys.size(); ++i) {
    auto d = ahead.Next(o.decision_timeout);
    if (!d.ok()) {
      run->failed = true;
      run->failure = absl::StrCat("microbatch ", keys[i].ToString(), ": ", d.status().ToString());
      return;
    }
    run->decisions.push_back(std::move(*d));
    if (o.interval > absl::ZeroDuration() && i + 1 < keys.size()) absl::SleepFor(o.interval);
  }
}

// One simulated rank's thread: once the gate opens, registers and plays the trace.
void PlayRank(const Trace& trace, const ReplayOptions& o, const std::string& address, World world,
              StartGate* gate, RankRun* run) {
  if (!gate->Wait()) return;
  auto worker = Worker::Connect(WorkerOptionsFor(o, address, world, run->rank));
  if (!worker.ok()) {
    run->failed = true;
    const absl::StatusCode code = worker.status().code();
    run->bad_input = code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kFailedPrecondition ||
                     code == absl::StatusCode::kAlreadyExists;
    run->failure = absl::StrCat("registration failed: ", worker.status().ToString());
    return;
  }
  if (!o.costs.empty()) (*worker)->ReportCosts(o.costs);
  PlayMicrobatches(trace, o, **worker, run);
  (*worker)->Close();
}

// The world and group sizes from the options and the trace; false (and one line on `err`)
// when they do not fit each other or the trace.
bool ResolveWorld(const Trace& trace, const ReplayOptions& o, std::ostream& err, World* world) {
  if (o.world_size <= 0 && int64_t{trace.max_rank} + 1 > kMaxReplayWorldSize) {
    err << "shardctl replay: the trace names rank " << trace.max_rank << ", so the world would have "
        << int64_t{trace.max_rank} + 1 << " ranks; a replay registers at most " << kMaxReplayWorldSize << "\n";
    return false;
  }
  world->size = o.world_size > 0 ? o.world_size : trace.max_rank + 1;
  if (trace.max_rank >= world->size) {
    err << "shardctl replay: the trace names rank " << trace.max_rank << " but --world-size is "
        << world->size << "\n";
    return false;
  }
  world->group_size = o.group_size > 0 ? o.group_size : world->size;
  if (world->size % world->group_size != 0) {
    err << "shardctl replay: --group-size " << world->group_size << " does not divide world size "
        << world->size << "\n";
    return false;
  }
  return true;
}

// Fills in o->modules (none given: every module the trace names); false (and one line on
// `err`) when the trace names a module not given.
bool ResolveModules(const Trace& trace, ReplayOptions* o, std::ostream& err) {
  if (o->modules.empty()) {
    for (const auto& name : trace.module_names) o->modules.push_back({name, 0, {}, false});
    return true;
  }
  std::set<std::string> known;
  for (const auto& m : o->modules) known.insert(m.name);
  for (const auto& name : trace.module_names) {
    if (!known.count(name)) {
      err << "shardctl replay: the trace names module '" << name
          << "' which is not among the modules given [" << absl::StrJoin(known, ", ")
          << "]; add it to --modules or the manifest\n";
      return false;
    }
  }
  return true;
}

// Fills in o->ranks (none given: every rank of the world); false (and one line on `err`)
// when there are more than one process plays or one is outside the world.
bool ResolveRanks(int world_size, ReplayOptions* o, std::ostream& err) {
  // One thread per simulated rank: refuse what the machine cannot run before starting any.
  const size_t simulated = o->ranks.empty() ? static_cast<size_t>(world_size) : o->ranks.size();
  if (simulated > static_cast<size_t>(kMaxReplayRanks)) {
    err << "shardctl replay: " << simulated << " ranks to simulate (world size " << world_size
        << ") is over " << kMaxReplayRanks
        << ", the most one replay process plays (one thread per rank); pick ranks with --ranks and run "
           "several replay processes against one coordinator (--coordinator)\n";
    return false;
  }
  if (o->ranks.empty()) {
    for (int r = 0; r < world_size; ++r) o->ranks.push_back(r);
  }
  for (int r : o->ranks) {
    if (r < 0 || r >= world_size) {
      err << "shardctl replay: --ranks names rank " << r << " outside 0.." << world_size - 1 << "\n";
      return false;
    }
  }
  return true;
}

// The coordinator the ranks play against: o.coordinator, or a shardcoordd started for the
// replay on 127.0.0.1:0 when that is empty (stopped when `daemon` goes). False (and one line on
// `err`) when it cannot start.
bool StartCoordinator(const ReplayOptions& o, std::ostream& err, std::unique_ptr<DaemonProcess>* daemon,
                      std::string* address) {
  *address = o.coordinator;
  if (!address->empty()) return true;
  absl::StatusOr<std::string> binary = FindDaemon(o.daemon);
  absl::StatusOr<std::unique_ptr<DaemonProcess>> started =
      binary.ok() ? DaemonProcess::Start(*binary, o.connect_timeout) : binary.status();
  if (!started.ok()) {
    err << "shardctl replay: " << started.status().message() << "\n";
    return false;
  }
  *daemon = std::move(*started);
  *address = (*daemon)->address();
  return true;
}

// Why the thread of a rank could not be started, after `started` others had been.
struct ThreadFailure {
  size_t started = 0;
  std::error_code error;  // Not e.what(): copying it could need memory there is none of.
};

// Plays every rank of `runs` (rank and group set), each on a thread of its own, and waits for
// them. When a thread cannot be started, no rank plays: says which one.
std::optional<ThreadFailure> PlayRanks(const Trace& trace, const ReplayOptions& o, const std::string& address,
                                       const World& world, std::vector<RankRun>* runs) {
  std::vector<std::thread> threads;
  threads.reserve(runs->size());
  StartGate gate;
  for (size_t i = 0; i < runs->size(); ++i) {
    std::error_code failure;
    try {
      threads.emplace_back(PlayRank, std::cref(trace), std::cref(o), address, world, &gate, &(*runs)[i]);
    } catch (const std::system_error& e) {  // Out of threads, or of memory for their stacks.
      failure = e.code();
    } catch (const std::bad_alloc&) {
      failure = std::make_error_code(std::errc::not_enough_memory);
    }
    if (failure) {
      // The threads started have done nothing yet: let them return, and say so, rather than
      // std::terminate.
      gate.Open(/*go=*/false);
      for (auto& t : threads) t.join();
      return ThreadFailure{i, failure};
    }
  }
  gate.Open(/*go=*/true);
  for (auto& t : threads) t.join();
  return std::nullopt;
}

// Names the ranks that failed on `err`; returns the exit code they make (kReplayOk when
// none failed) and counts them in *failed_ranks.
int ReportFailedRanks(const std::vector<RankRun>& runs, std::ostream& err, int* failed_ranks) {
  int rc = kReplayOk;
  for (const auto& run : runs) {
    if (run.failed) {
      err << "shardctl replay: rank " << run.rank << " (group " << run.group
          << ") failed after " << run.decisions.size() << " microbatches: " << run.failure << "\n";
      ++*failed_ranks;
      if (rc != kReplayRankFailed) rc = run.bad_input ? kReplayBadInput : kReplayRankFailed;
    }
  }
  return rc;
}

// (group, microbatch) -> the first rank that received its decision, and the decision.
using GroupDecisions = std::map<std::pair<int, MicrobatchKey>, std::pair<int, const MicrobatchDecision*>>;

// The invariant: every played rank of a group holds the identical decision. Names each
// divergence on `err` and sets *diverged.
GroupDecisions CheckAgreement(const std::vector<RankRun>& runs, std::ostream& err, bool* diverged) {
  GroupDecisions first;
  for (const auto& run : runs) {
    for (const auto& d : run.decisions) {
      auto [it, inserted] = first.try_emplace({run.group, d.key}, run.rank, &d);
      if (!inserted && !SameDecision(*it->second.second, d)) {
        err << "shardctl replay: DECISIONS DIVERGED in group " << run.group << " at "
            << d.key.ToString() << ": rank " << it->second.first << " got "
            << DescribeModules(*it->second.second) << ", rank " << run.rank << " got "
            << DescribeModules(d) << "\n";
        *diverged = true;
      }
    }
  }
  return first;
}

// (microbatch, rank or group, decision) rows, sorted by microbatch, then rank or group.
using DecisionRows = std::vector<std::tuple<MicrobatchKey, int, const MicrobatchDecision*>>;

void SortRows(DecisionRows* rows) {
  std::sort(rows->begin(), rows->end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
  });
}

// --per-rank: what each rank received, by microbatch, then rank.
void PrintPerRank(const std::vector<RankRun>& runs, std::ostream& out) {
  DecisionRows rows;
  for (const auto& run : runs) {
    for (const auto& d : run.decisions) rows.emplace_back(d.key, run.rank, &d);
  }
  SortRows(&rows);
  for (const auto& [key, rank, d] : rows) {
    for (const auto& m : d->modules) out << DecisionLine(rank, *d, m) << "\n";
  }
}

// Counts the group decisions by kind (and the divergent ones); prints them unless --per-rank.
std::map<std::string, int64_t> CountGroupDecisions(const GroupDecisions& first, bool print, std::ostream& out) {
  std::map<std::string, int64_t> counts;
  DecisionRows rows;
  for (const auto& [gk, rd] : first) rows.emplace_back(gk.second, gk.first, rd.second);
  SortRows(&rows);
  for (const auto& [key, group, d] : rows) {
    for (const auto& m : d->modules) {
      counts[DecisionName(m.decision)]++;
      if (m.reason == DecisionReason::kDivergent) counts["divergent"]++;
      if (print) out << DecisionLine(/*rank=*/-1, *d, m) << "\n";
    }
  }
  return counts;
}

// The summary line on `err`.
void PrintSummary(const Trace& trace, const ReplayOptions& o, const std::vector<RankRun>& runs,
                  std::map<std::string, int64_t>& counts, bool diverged, int failed_ranks, std::ostream& err) {
  std::set<int> groups;
  for (const auto& run : runs) groups.insert(run.group);
  err << "shardctl replay: job '" << o.job_id << "': ranks " << absl::StrJoin(o.ranks, ",")
      << " in groups " << absl::StrJoin(groups, ",") << ", " << trace.keys.size()
      << " microbatches, " << o.modules.size() << " modules; group decisions: " << KindCounts(counts)
      << " (divergent=" << counts["divergent"] << "); "
      << (diverged           ? "RANKS DISAGREE"
          : failed_ranks > 0 ? absl::StrCat(failed_ranks, " of ", runs.size(),
                                            " ranks FAILED; the decisions the others received agree")
                             : std::string("every rank of each group received identical decisions"))
      << "\n";
}

// What the ranks received: checked, printed and summed up. Returns the exit code.
int ReportRuns(const Trace& trace, const ReplayOptions& o, const std::vector<RankRun>& runs, std::ostream& out,
               std::ostream& err) {
  int failed_ranks = 0;
  const int rc = ReportFailedRanks(runs, err, &failed_ranks);
  bool diverged = false;
  const GroupDecisions first = CheckAgreement(runs, err, &diverged);
  if (o.per_rank) PrintPerRank(runs, out);
  std::map<std::string, int64_t> counts = CountGroupDecisions(first, /*print=*/!o.per_rank, out);
  out.flush();
  PrintSummary(trace, o, runs, counts, diverged, failed_ranks, err);
  return diverged ? kReplayDiverged : rc;
}

}  // namespace

int RunReplay(const Trace& trace, ReplayOptions o, std::ostream& out, std::ostream& err) {
  World world;
  if (!ResolveWorld(trace, o, err, &world) || !ResolveModules(trace, &o, err) ||
      !ResolveRanks(world.size, &o, err)) {
    return kReplayBadInput;
  }
  std::unique_ptr<DaemonProcess> daemon;
  std::string address;
  if (!StartCoordinator(o, err, &daemon, &address)) return kReplayRankFailed;
  std::vector<RankRun> runs(o.ranks.size());
  for (size_t i = 0; i < o.ranks.size(); ++i) {
    runs[i].rank = o.ranks[i];
    runs[i].group = o.ranks[i] / world.group_size;
  }
  const std::optional<ThreadFailure> failure = PlayRanks(trace, o, address, world, &runs);
  daemon.reset();
  if (failure) {
    err << "shardctl replay: cannot start the thread of rank " << o.ranks[failure->started] << " ("
        << failure->started << " of " << o.ranks.size() << " started): " << failure->error.message()
        << "; play fewer ranks per process with --ranks\n";
    return kReplayBadInput;
  }
  return ReportRuns(trace, o, runs, out, err);
}

namespace {

// (group, step, microbatch, module): one group decision in `shardctl verify`.
using VerifyKey = std::tuple<int, int64_t, int32_t, std::string>;

// What `shardctl verify` has read so far.
struct VerifyState {
  struct Seen {
    std::string decision;
    uint64_t seq;
    int rank;
    int32_t calls;  // A padded decision's passes (0 otherwise).
    bool operator==(const Seen& o) const { return decision == o.decision && seq == o.seq && calls == o.calls; }
    std::string Text() const {
      return absl::StrCat(decision, calls ? absl::StrCat(" (", calls, " passes)") : "", " seq ", seq);
    }
  };
  std::map<VerifyKey, Seen> seen;               // The first rank's decision.
  std::map<VerifyKey, std::set<int>> holders;   // The ranks that have it.
  std::map<int, std::set<int>> group_ranks;     // The ranks each group's outputs came from.
  std::set<int> ranks;
  int mismatches = 0;
};

// Not a `shardctl replay --per-rank` line: a field whose number is no integer of its type.
struct BadPerRankField : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// The integer `field` of a per-rank line, within T's range (and int64's: a seq never comes
// near 2^63). A fraction, a number out of range or one past int64 (which the JSON library
// holds as a double) throws BadPerRankField rather than being cast or wrapped; a missing
// field throws as nlohmann's at() does.
template <typename T>
T IntegerAt(const nlohmann::json& j, const char* field, bool non_negative = false) {
  const nlohmann::json& v = j.at(field);
  const int64_t min = non_negative ? 0 : static_cast<int64_t>(std::numeric_limits<T>::min());
  const int64_t max = static_cast<int64_t>(
      std::min<uint64_t>(static_cast<uint64_t>(std::numeric_limits<T>::max()), INT64_MAX));
  if (!JsonIntegerIn(v, min, max)) {
    throw BadPerRankField(absl::StrCat("'", field, "' is ", JsonShown(v), ", not an integer in ", min, "..", max));
  }
  return static_cast<T>(v.get<int64_t>());
}

// Adds one `shardctl replay --per-rank` line; names a mismatch on `err` (the first 10).
// Throws nlohmann::json::exception or BadPerRankField when it is not such a line.
void AddPerRankLine(const std::string& line, VerifyState* state, std::ostream& err) {
  const nlohmann::json j = nlohmann::json::parse(line);
  // Ranks, groups and keys are never negative; the strings are shown escaped (a file is anyone's).
  VerifyKey key = std::make_tuple(IntegerAt<int>(j, "group", true), IntegerAt<int64_t>(j, "step", true),
                                  IntegerAt<int32_t>(j, "microbatch", true), Printable(j.at("module").get<std::string>()));
  const std::string decision = j.at("decision").get<std::string>();
  if (!ParseDecision(decision)) {
    throw BadPerRankField(absl::StrCat("'decision' is '", Printable(decision, 64), "', not one of ",
                                       absl::StrJoin(DecisionNames(), ", ")));
  }
  VerifyState::Seen s{decision, IntegerAt<uint64_t>(j, "seq"), IntegerAt<int>(j, "rank", true),
                      j.contains("calls") ? IntegerAt<int32_t>(j, "calls", true) : 0};
  state->ranks.insert(s.rank);
  state->group_ranks[std::get<0>(key)].insert(s.rank);
  state->holders[key].insert(s.rank);
  auto [it, inserted] = state->seen.try_emplace(key, s);
  if (inserted || it->second == s) return;
  if (++state->mismatches <= 10) {
    err << "shardctl verify: DECISIONS DIVERGED in group " << std::get<0>(key) << " at ("
        << std::get<1>(key) << "," << std::get<2>(key) << ") module " << std::get<3>(key)
        << ": rank " << it->second.rank << " got " << it->second.Text() << ", rank " << s.rank << " got "
        << s.Text() << "\n";
  }
}

// Reads one rank's output; false (and one line on `err`) when it is empty or not replay output.
bool ReadPerRankFile(const std::string& path, VerifyState* state, std::ostream& err) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    // /dev/zero, a FIFO or a terminal would be read forever (or taken as empty).
    err << "shardctl verify: " << Printable(path) << " is not a regular file: give the files `shardctl replay "
        << "--per-rank` wrote\n";
    return false;
  }
  std::ifstream in(path);
  if (in.peek() == std::ifstream::traits_type::eof()) {
    err << "shardctl verify: " << path
        << " holds no decisions (did that rank fail? see its stderr)\n";
    return false;
  }
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    std::string why;  // Copied: the exception is gone after its handler.
    try {
      AddPerRankLine(line, state, err);
    } catch (const nlohmann::json::exception& e) {
      why = e.what();
    } catch (const BadPerRankField& e) {
      why = e.what();
    }
    if (!why.empty()) {
      err << "shardctl verify: " << path << ":" << lineno << ": not a `shardctl replay --per-rank` line (" << why
          << ")\n";
      return false;
    }
  }
  return true;
}

// Agreement needs every rank of a group to show the decision: a rank whose output lacks
// most microbatches (it failed, or its file was cut) must not pass as agreeing. Counts the
// decisions some rank of a group lacks and names the first 10 on `err`.
int64_t CountMissing(const VerifyState& state, bool complete, std::ostream& err) {
  int64_t missing = 0;
  for (const auto& [key, who] : state.holders) {
    const std::set<int>& all = state.group_ranks.at(std::get<0>(key));
    if (who.size() == all.size()) continue;
    for (int r : all) {
      if (who.count(r) || ++missing > 10) continue;
      err << "shardctl verify: " << (complete ? "MISSING" : "note") << ": rank " << r << " of group " << std::get<0>(key) << " has no decision for ("
          << std::get<1>(key) << "," << std::get<2>(key) << ") module " << std::get<3>(key)
          << ", which other ranks of its group received\n";
    }
  }
  return missing;
}

void PrintVerifySummary(const VerifyState& state, int64_t missing, bool complete, std::ostream& out) {
  std::map<std::string, int64_t> counts;
  for (const auto& [key, s] : state.seen) counts[s.decision]++;
  out << "verified " << state.seen.size() << " group decisions from ranks " << absl::StrJoin(state.ranks, ",")
      << ": " << KindCounts(counts) << "; "
      << (state.mismatches ? absl::StrCat(state.mismatches, " MISMATCHES")
          : missing && complete
              ? absl::StrCat(missing, " decisions MISSING from some rank's output")
              : absl::StrCat("all ranks of each group agree",
                             missing ? absl::StrCat(" (", missing, " decisions lacking from some rank's output: a "
                                                    "rank that ended early? --complete fails on them)")
                                     : ""))
      << "\n";
}

}  // namespace

int VerifyPerRankOutputs(const std::vector<std::string>& files, std::ostream& out,
                         std::ostream& err, bool complete) {
  VerifyState state;
  for (const auto& path : files) {
    if (!ReadPerRankFile(path, &state, err)) return kReplayBadInput;
  }
  // A group with outputs of several ranks must have something in two of them to compare.
  std::map<int, int64_t> compared;  // group -> decisions held by two ranks or more
  for (const auto& [key, who] : state.holders) compared[std::get<0>(key)] += who.size() > 1;
  for (const auto& [group, ranks] : state.group_ranks) {
    if (ranks.size() < 2 || compared[group] > 0) continue;
    err << "shardctl verify: the outputs of ranks " << absl::StrJoin(ranks, ",") << " of group " << group
        << " share no decision (no microbatch and module is in two of them): nothing was compared. Are they "
        << "of one job?\n";
    return kReplayBadInput;
  }
  const int64_t missing = CountMissing(state, complete, err);
  PrintVerifySummary(state, missing, complete, out);
  return state.mismatches || (missing && complete) ? kReplayDiverged : kReplayOk;
}

}  // namespace shardcoord::client
