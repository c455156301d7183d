#include "replay.h"

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/coordinator_server.h"
#include "shardcoord/plan_ahead.h"
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

std::string DescribeModules(const MicrobatchDecision& d) {
  std::vector<std::string> parts;
  for (const auto& m : d.modules) parts.push_back(absl::StrCat(m.module, "=", DecisionName(m.decision)));
  return absl::StrCat("seq ", d.seq, " [", absl::StrJoin(parts, " "), "]");
}

// One output line: {"rank":R (with --per-rank),"group":..,"step":..,"microbatch":..,
// "module":..,"decision":..,"seq":..,"reason":..}.
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

void PlayRank(const Trace& trace, const ReplayOptions& o, const std::string& address,
              int world_size, int group_size, StartGate* gate, RankRun* run) {
  if (!gate->Wait()) return;
  WorkerOptions wo;
  wo.coordinator_address = address;
  wo.job_id = o.job_id;
  wo.rank = run->rank;
  wo.world_size = world_size;
  wo.group_size = group_size;
  wo.modules = o.modules;
  wo.policy = o.policy;
  wo.fallback = o.fallback;
  wo.wrap_outer_model = o.wrap_outer_model;
  wo.lookahead = o.lookahead;
  wo.memory_budget_bytes = o.memory_budget_bytes;
  wo.connect_timeout = o.connect_timeout;
  wo.reconnect_window = o.reconnect_window;
  wo.tls = o.tls;
  auto worker = Worker::Connect(wo);
  if (!worker.ok()) {
    run->failed = true;
    const absl::StatusCode code = worker.status().code();
    run->bad_input = code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kFailedPrecondition ||
                     code == absl::StatusCode::kAlreadyExists;
    run->failure = absl::StrCat("registration failed: ", worker.status().ToString());
    return;
  }
  const std::vector<MicrobatchKey> keys(trace.keys.begin(), trace.keys.end());
  auto plans_it = trace.plans.find(run->rank);
  PlanAhead ahead(**worker, static_cast<int64_t>(keys.size()), [&](int64_t i) {
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
      (*worker)->Close();
      return;
    }
    run->decisions.push_back(std::move(*d));
    if (o.interval > absl::ZeroDuration() && i + 1 < keys.size()) absl::SleepFor(o.interval);
  }
  (*worker)->Close();
}

}  // namespace

int RunReplay(const Trace& trace, ReplayOptions o, std::ostream& out, std::ostream& err) {
  if (o.world_size <= 0 && int64_t{trace.max_rank} + 1 > kMaxReplayWorldSize) {
    err << "shardctl replay: the trace names rank " << trace.max_rank << ", so the world would have "
        << int64_t{trace.max_rank} + 1 << " ranks; a replay registers at most " << kMaxReplayWorldSize << "\n";
    return kReplayBadInput;
  }
  const int world_size = o.world_size > 0 ? o.world_size : trace.max_rank + 1;
  if (trace.max_rank >= world_size) {
    err << "shardctl replay: the trace names rank " << trace.max_rank << " but --world-size is "
        << world_size << "\n";
    return kReplayBadInput;
  }
  const int group_size = o.group_size > 0 ? o.group_size : world_size;
  if (world_size % group_size != 0) {
    err << "shardctl replay: --group-size " << group_size << " does not divide world size "
        << world_size << "\n";
    return kReplayBadInput;
  }
  if (o.modules.empty()) {
    for (const auto& name : trace.module_names) o.modules.push_back({name, 0, {}, false});
  } else {
    std::set<std::string> known;
    for (const auto& m : o.modules) known.insert(m.name);
    for (const auto& name : trace.module_names) {
      if (!known.count(name)) {
        err << "shardctl replay: the trace names module '" << name
            << "' which is not among the modules given [" << absl::StrJoin(known, ", ")
            << "]; add it to --modules or the manifest\n";
        return kReplayBadInput;
      }
    }
  }
  // One thread per simulated rank: refuse what the machine cannot run before starting any.
  const size_t simulated = o.ranks.empty() ? static_cast<size_t>(world_size) : o.ranks.size();
  if (simulated > static_cast<size_t>(kMaxReplayRanks)) {
    err << "shardctl replay: " << simulated << " ranks to simulate (world size " << world_size
        << ") is over " << kMaxReplayRanks
        << ", the most one replay process plays (one thread per rank); pick ranks with --ranks and run "
           "several replay processes against one coordinator (--coordinator)\n";
    return kReplayBadInput;
  }
  if (o.ranks.empty()) {
    for (int r = 0; r < world_size; ++r) o.ranks.push_back(r);
  }
  for (int r : o.ranks) {
    if (r < 0 || r >= world_size) {
      err << "shardctl replay: --ranks names rank " << r << " outside 0.." << world_size - 1 << "\n";
      return kReplayBadInput;
    }
  }

  std::unique_ptr<coordinator::CoordinatorServer> embedded;
  std::string address = o.coordinator;
  if (address.empty()) {
    coordinator::CoordinatorOptions co;
    co.listen_address = "127.0.0.1:0";
    auto server = coordinator::CoordinatorServer::Start(co);
    if (!server.ok()) {
      err << "shardctl replay: cannot start the embedded coordinator: " << server.status().message()
          << "\n";
      return kReplayRankFailed;
    }
    embedded = std::move(*server);
    address = embedded->address();
  }

  std::vector<RankRun> runs(o.ranks.size());
  std::vector<std::thread> threads;
  threads.reserve(o.ranks.size());
  StartGate gate;
  for (size_t i = 0; i < o.ranks.size(); ++i) {
    runs[i].rank = o.ranks[i];
    runs[i].group = o.ranks[i] / group_size;
    std::error_code failure;  // Not e.what(): copying it could need memory there is none of.
    try {
      threads.emplace_back(PlayRank, std::cref(trace), std::cref(o), address, world_size, group_size,
                           &gate, &runs[i]);
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
      if (embedded) embedded->Shutdown();
      err << "shardctl replay: cannot start the thread of rank " << o.ranks[i] << " (" << i << " of "
          << o.ranks.size() << " started): " << failure.message()
          << "; play fewer ranks per process with --ranks\n";
      return kReplayBadInput;
    }
  }
  gate.Open(/*go=*/true);
  for (auto& t : threads) t.join();
  if (embedded) embedded->Shutdown();

  int rc = kReplayOk;
  int failed_ranks = 0;
  for (const auto& run : runs) {
    if (run.failed) {
      err << "shardctl replay: rank " << run.rank << " (group " << run.group
          << ") failed after " << run.decisions.size() << " microbatches: " << run.failure << "\n";
      ++failed_ranks;
      if (rc != kReplayRankFailed) rc = run.bad_input ? kReplayBadInput : kReplayRankFailed;
    }
  }

  // The invariant: every played rank of a group holds the identical decision.
  std::map<std::pair<int, MicrobatchKey>, std::pair<int, const MicrobatchDecision*>> first;
  bool diverged = false;
  for (const auto& run : runs) {
    for (const auto& d : run.decisions) {
      auto [it, inserted] = first.try_emplace({run.group, d.key}, run.rank, &d);
      if (!inserted && !SameDecision(*it->second.second, d)) {
        err << "shardctl replay: DECISIONS DIVERGED in group " << run.group << " at "
            << d.key.ToString() << ": rank " << it->second.first << " got "
            << DescribeModules(*it->second.second) << ", rank " << run.rank << " got "
            << DescribeModules(d) << "\n";
        diverged = true;
      }
    }
  }

  std::map<std::string, int64_t> counts;
  if (o.per_rank) {
    std::vector<std::tuple<MicrobatchKey, int, const MicrobatchDecision*>> rows;
    for (const auto& run : runs) {
      for (const auto& d : run.decisions) rows.emplace_back(d.key, run.rank, &d);
    }
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
    });
    for (const auto& [key, rank, d] : rows) {
      for (const auto& m : d->modules) out << DecisionLine(rank, *d, m) << "\n";
    }
  }
  std::vector<std::tuple<MicrobatchKey, int, const MicrobatchDecision*>> rows;
  for (const auto& [gk, rd] : first) rows.emplace_back(gk.second, gk.first, rd.second);
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
  });
  for (const auto& [key, group, d] : rows) {
    for (const auto& m : d->modules) {
      counts[DecisionName(m.decision)]++;
      if (m.reason == DecisionReason::kDivergent) counts["divergent"]++;
      if (!o.per_rank) out << DecisionLine(/*rank=*/-1, *d, m) << "\n";
    }
  }
  out.flush();

  std::set<int> groups;
  for (const auto& run : runs) groups.insert(run.group);
  err << "shardctl replay: job '" << o.job_id << "': ranks " << absl::StrJoin(o.ranks, ",")
      << " in groups " << absl::StrJoin(groups, ",") << ", " << trace.keys.size()
      << " microbatches, " << o.modules.size() << " modules; group decisions: per_layer="
      << counts["per_layer"] << " skip=" << counts["skip"] << " root=" << counts["root"]
      << " replicate=" << counts["replicate"] << " (divergent=" << counts["divergent"] << "); "
      << (diverged           ? "RANKS DISAGREE"
          : failed_ranks > 0 ? absl::StrCat(failed_ranks, " of ", runs.size(),
                                            " ranks FAILED; the decisions the others received agree")
                             : std::string("every rank of each group received identical decisions"))
      << "\n";
  if (diverged) return kReplayDiverged;
  return rc;
}

int VerifyPerRankOutputs(const std::vector<std::string>& files, std::ostream& out,
                         std::ostream& err, bool complete) {
  struct Seen {
    std::string decision;
    uint64_t seq;
    int rank;
  };
  // (group, step, microbatch, module) -> first rank's decision, and the ranks that have it.
  std::map<std::tuple<int, int64_t, int32_t, std::string>, Seen> seen;
  std::map<std::tuple<int, int64_t, int32_t, std::string>, std::set<int>> holders;
  std::map<int, std::set<int>> group_ranks;  // The ranks each group's outputs came from.
  std::set<int> ranks;
  int mismatches = 0;
  for (const auto& path : files) {
    std::ifstream in(path);
    if (in.peek() == std::ifstream::traits_type::eof()) {
      err << "shardctl verify: " << path
          << " holds no decisions (did that rank fail? see its stderr)\n";
      return kReplayBadInput;
    }
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (line.empty()) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
        auto key = std::make_tuple(j.at("group").get<int>(), j.at("step").get<int64_t>(),
                                   j.at("microbatch").get<int32_t>(), j.at("module").get<std::string>());
        Seen s{j.at("decision").get<std::string>(), j.at("seq").get<uint64_t>(), j.at("rank").get<int>()};
        ranks.insert(s.rank);
        group_ranks[std::get<0>(key)].insert(s.rank);
        holders[key].insert(s.rank);
        auto [it, inserted] = seen.try_emplace(key, s);
        if (!inserted && (it->second.decision != s.decision || it->second.seq != s.seq)) {
          if (++mismatches <= 10) {
            err << "shardctl verify: DECISIONS DIVERGED in group " << std::get<0>(key) << " at ("
                << std::get<1>(key) << "," << std::get<2>(key) << ") module " << std::get<3>(key)
                << ": rank " << it->second.rank << " got " << it->second.decision << " seq "
                << it->second.seq << ", rank " << s.rank << " got " << s.decision << " seq " << s.seq
                << "\n";
          }
        }
      } catch (const nlohmann::json::exception& e) {
        err << "shardctl verify: " << path << ":" << lineno
            << ": not a `shardctl replay --per-rank` line (" << e.what() << ")\n";
        return kReplayBadInput;
      }
    }
  }
  // Agreement needs every rank of a group to show the decision: a rank whose output lacks
  // most microbatches (it failed, or its file was cut) must not pass as agreeing.
  int64_t missing = 0;
  for (const auto& [key, who] : holders) {
    const std::set<int>& all = group_ranks[std::get<0>(key)];
    if (who.size() == all.size()) continue;
    for (int r : all) {
      if (who.count(r) || ++missing > 10) continue;
      err << "shardctl verify: " << (complete ? "MISSING" : "note") << ": rank " << r << " of group " << std::get<0>(key) << " has no decision for ("
          << std::get<1>(key) << "," << std::get<2>(key) << ") module " << std::get<3>(key)
          << ", which other ranks of its group received\n";
    }
  }
  std::map<std::string, int64_t> counts;
  for (const auto& [key, s] : seen) counts[s.decision]++;
  out << "verified " << seen.size() << " group decisions from ranks " << absl::StrJoin(ranks, ",")
      << ": per_layer=" << counts["per_layer"] << " skip=" << counts["skip"]
      << " root=" << counts["root"] << " replicate=" << counts["replicate"] << "; "
      << (mismatches ? absl::StrCat(mismatches, " MISMATCHES")
          : missing && complete
              ? absl::StrCat(missing, " decisions MISSING from some rank's output")
              : absl::StrCat("all ranks of each group agree",
                             missing ? absl::StrCat(" (", missing, " decisions lacking from some rank's output: a "
                                                    "rank that ended early? --complete fails on them)")
                                     : ""))
      << "\n";
  return mismatches || (missing && complete) ? kReplayDiverged : kReplayOk;
}

}  // namespace shardcoord::client
