#include "plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "coordinator/engine/decision_engine.h"

namespace shardcoord::client {

namespace {

using Calls = std::vector<std::vector<int32_t>>;  // calls[m][i]: module m, member i.

// Largest inputs the planner takes: their products stay far inside int64.
constexpr int64_t kMaxPlanModuleBytes = int64_t{1} << 44;  // 16 TiB.
constexpr int32_t kMaxPlanCallsPerMicrobatch = 1 << 16;

constexpr std::pair<PlanPolicy, const char*> kPolicyNames[] = {
    {PlanPolicy::kRoot, "root"},   {PlanPolicy::kReplicate, "replicate"},     {PlanPolicy::kPerLayer, "per_layer"},
    {PlanPolicy::kDummy, "dummy"}, {PlanPolicy::kScPerLayer, "sc_per_layer"}, {PlanPolicy::kAuto, "auto"},
};

}  // namespace

const char* PlanPolicyName(PlanPolicy p) {
  for (const auto& [policy, name] : kPolicyNames) {
    if (policy == p) return name;
  }
  return "?";
}

std::optional<PlanPolicy> ParsePlanPolicy(std::string_view name) {
  for (const auto& [policy, policy_name] : kPolicyNames) {
    if (name == policy_name) return policy;
  }
  return std::nullopt;
}

namespace {

// How often a trace line calls `module` (no line: never).
int32_t CallsOf(const std::map<std::string, int32_t>* line, const std::string& module) {
  if (line == nullptr) return 0;
  auto it = line->find(module);
  return it == line->end() ? 0 : it->second;
}

// One rank's entries of a per-rank map of the trace (its lines, or its tokens), walked in key
// order: each entry is passed once.
template <typename Lines>
class MemberWalk {
 public:
  MemberWalk(const std::map<int, Lines>& per_rank, int rank) {
    auto it = per_rank.find(rank);
    if (it != per_rank.end()) {
      lines_ = &it->second;
      next_ = lines_->begin();
    }
  }

  // The entry of `key` (nullptr: none); keys must come in increasing order.
  const typename Lines::mapped_type* At(const MicrobatchKey& key) {
    if (lines_ == nullptr) return nullptr;
    while (next_ != lines_->end() && next_->first < key) ++next_;
    return next_ != lines_->end() && next_->first == key ? &next_->second : nullptr;
  }

 private:
  const Lines* lines_ = nullptr;  // None: the trace never names the rank.
  typename Lines::const_iterator next_;
};

// The calls of one group's members, microbatch by microbatch: 0 where the trace has no line
// or the line does not name the module; and the most tokens any member's line gives.
class GroupCalls {
 public:
  GroupCalls(const Trace& trace, const std::vector<ModuleSpec>& modules, int group, int group_size)
      : modules_(modules), calls_(modules.size(), std::vector<int32_t>(group_size, 0)) {
    for (int i = 0; i < group_size; ++i) {
      lines_.emplace_back(trace.plans, group * group_size + i);
      tokens_.emplace_back(trace.tokens, group * group_size + i);
    }
  }

  // The calls in `key`; keys must come in increasing order (each member's lines are walked
  // once, so a group costs its lines, not lines x keys). Then tokens() is the key's.
  const Calls& At(const MicrobatchKey& key) {
    most_tokens_ = 0;
    for (size_t i = 0; i < lines_.size(); ++i) {
      const std::map<std::string, int32_t>* line = lines_[i].At(key);
      for (size_t m = 0; m < modules_.size(); ++m) calls_[m][i] = CallsOf(line, modules_[m].name);
      if (const int64_t* tokens = tokens_[i].At(key)) most_tokens_ = std::max(most_tokens_, *tokens);
    }
    return calls_;
  }
  int64_t tokens() const { return most_tokens_; }

 private:
  const std::vector<ModuleSpec>& modules_;
  std::vector<MemberWalk<std::map<MicrobatchKey, std::map<std::string, int32_t>>>> lines_;
  std::vector<MemberWalk<std::map<MicrobatchKey, int64_t>>> tokens_;
  Calls calls_;
  int64_t most_tokens_ = 0;
};

bool UsesEngine(PlanPolicy p) { return p == PlanPolicy::kAuto || p == PlanPolicy::kScPerLayer; }

// The one place the planner configures the daemon's DecisionEngine: as shardcoordd would for
// a group registered with this policy (the options' fallback, the default promotion settings) whose
// members report `setup.budget_bytes` as their memory budget and the cost file's costs (so
// `auto` decides by cost, as it does once workers report). It prices whatever the engine
// decides with EstimatePlacement.
coordinator::DecisionEngine MakeEngine(const PlanSetup& setup, int group, PlanPolicy policy) {
  coordinator::EngineConfig config;
  config.group = group;
  config.policy = policy == PlanPolicy::kAuto ? Policy::kAuto : Policy::kPerLayer;
  config.fallback = setup.fallback;
  config.modules = setup.modules;
  config.group_size = setup.group_size;
  config.costs = setup.costs;
  coordinator::DecisionEngine engine(std::move(config));
  engine.SetMinMemoryBudget(setup.budget_bytes);
  return engine;
}

// A static policy's placement of one module (per_layer: skip when nobody calls it; dummy never
// skips: a rank cannot know that no other rank calls it).
Decision StaticDecision(PlanPolicy policy, const std::vector<int32_t>& calls) {
  if (policy == PlanPolicy::kRoot) return Decision::kRoot;
  if (policy == PlanPolicy::kReplicate) return Decision::kReplicate;
  if (policy == PlanPolicy::kDummy) return Decision::kPerLayer;
  const bool nobody = std::all_of(calls.begin(), calls.end(), [](int32_t c) { return c == 0; });
  return nobody ? Decision::kSkip : Decision::kPerLayer;
}

// Each module's placement in `key` into `decided`: the engine's (called in key order, as the
// daemon calls it) or the static policy's.
void DecideMicrobatch(PlanPolicy policy, coordinator::DecisionEngine* engine, const MicrobatchKey& key,
                      const Calls& calls, std::vector<Decision>* decided) {
  if (engine != nullptr) {
    const MicrobatchDecision d = engine->Decide(key, /*epoch=*/0, calls);
    for (size_t m = 0; m < calls.size(); ++m) (*decided)[m] = d.modules[m].decision;
    return;
  }
  for (size_t m = 0; m < calls.size(); ++m) (*decided)[m] = StaticDecision(policy, calls[m]);
}

// The shared estimate of one module's placement. Dummy forwards: every rank runs the module
// as often as the busiest one, so per_layer is priced on uniform calls.
PlacementEstimate EstimateModule(const PlanSetup& s, PlanPolicy policy, size_t m, Decision decision,
                                 const std::vector<int32_t>& calls, bool replica_resident) {
  CostInputs in;
  in.spec = &s.modules[m];
  in.cost = s.costs[m];
  in.group_size = s.group_size;
  in.budget_bytes = s.budget_bytes;
  in.replica_resident = replica_resident;
  if (policy == PlanPolicy::kDummy) {
    return EstimatePlacement(in, decision, std::vector<int32_t>(calls.size(), s.most_calls[m]));
  }
  return EstimatePlacement(in, decision, calls);
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  return a > std::numeric_limits<int64_t>::max() - b ? std::numeric_limits<int64_t>::max() : a + b;
}

// One group's figures under one policy.
struct GroupTotals {
  std::array<int64_t, 6> decisions{};
  int64_t microbatches = 0;
  int64_t hangs = 0;
  int64_t peak_bytes = 0;
  std::vector<double> step_seconds;   // Per step (index in key order).
  std::vector<double> step_gathered;  // Bytes per rank.
};

// The seconds of a group microbatch outside the modules' placements (the decoder, the rest of
// the model, the optimizer's share): the same under every placement, on the group's busiest
// rank. Per token when the trace gives tokens and the cost file prices them (`tokens`: the most
// any member's microbatch has); otherwise per microbatch, plus the rest of the model's work on
// what each module's calls produced (the decoder on the image tokens) for the most calls any
// member makes.
double OtherSeconds(const PlanSetup& s, const Calls& calls, int64_t tokens) {
  if (s.per_token) {
    const double extra = s.other_seconds_per_token * static_cast<double>(tokens - s.other_tokens_per_microbatch);
    return std::max(0.0, s.other_seconds_per_microbatch + extra);
  }
  double seconds = s.other_seconds_per_microbatch;
  for (size_t m = 0; m < calls.size(); ++m) {
    seconds += s.other_seconds_per_call[m] * *std::max_element(calls[m].begin(), calls[m].end());
  }
  return seconds;
}

// Adds one group microbatch of `tokens` (the busiest member's), whose modules were placed as
// `decided`. `resident[m]`: the group holds a replica of module m (built by an earlier replicate
// decision; static replicate builds it before training).
void AddMicrobatch(const PlanSetup& s, PlanPolicy policy, const std::vector<Decision>& decided, const Calls& calls,
                   int64_t tokens, size_t step, std::vector<bool>* resident, GroupTotals* t) {
  double seconds = OtherSeconds(s, calls, tokens);
  double gathered = 0;
  int64_t peak = 0;
  bool hang = false;
  for (size_t m = 0; m < decided.size(); ++m) {
    const PlacementEstimate e = EstimateModule(s, policy, m, decided[m], calls[m], (*resident)[m]);
    seconds += e.seconds;
    gathered += static_cast<double>(e.gathered_bytes);
    peak = SaturatingAdd(peak, e.peak_bytes);
    hang = hang || !e.safe;
    t->decisions[static_cast<size_t>(decided[m])]++;
    if (policy != PlanPolicy::kReplicate) (*resident)[m] = decided[m] == Decision::kReplicate;
  }
  t->microbatches++;
  t->hangs += hang ? 1 : 0;
  t->peak_bytes = std::max(t->peak_bytes, peak);
  t->step_seconds[step] += seconds;
  t->step_gathered[step] += gathered;
}

// Plays every microbatch of the trace through one group, in key order.
GroupTotals SimulateGroup(const PlanSetup& s, PlanPolicy policy, int group, size_t steps) {
  GroupCalls calls(*s.trace, s.modules, group, s.group_size);
  std::optional<coordinator::DecisionEngine> engine;
  if (UsesEngine(policy)) engine.emplace(MakeEngine(s, group, policy));
  std::vector<bool> resident(s.modules.size(), policy == PlanPolicy::kReplicate);
  std::vector<Decision> decided(s.modules.size());
  GroupTotals t;
  t.step_seconds.assign(steps, 0);
  t.step_gathered.assign(steps, 0);
  size_t step = 0;
  int64_t current_step = s.trace->keys.begin()->step;
  for (const MicrobatchKey& key : s.trace->keys) {
    if (key.step != current_step) {
      ++step;
      current_step = key.step;
    }
    const Calls& c = calls.At(key);
    DecideMicrobatch(policy, engine ? &*engine : nullptr, key, c, &decided);
    AddMicrobatch(s, policy, decided, c, calls.tokens(), step, &resident, &t);
  }
  return t;
}

size_t CountSteps(const std::set<MicrobatchKey>& keys) {
  size_t n = 0;
  int64_t last = -1;
  for (const MicrobatchKey& k : keys) {
    if (n == 0 || k.step != last) ++n;
    last = k.step;
  }
  return n;
}

// Some rank of `group` has a line in the trace.
bool GroupInTrace(const Trace& trace, int group, int group_size) {
  auto it = trace.plans.lower_bound(group * group_size);
  return it != trace.plans.end() && it->first < (group + 1) * group_size;
}

// Adds `weight` groups alike, each `g`, to the policy's figures: counts add up; per step the
// busiest group counts; the peak is the largest.
void Merge(const GroupTotals& g, int64_t weight, GroupTotals* total) {
  for (size_t d = 0; d < g.decisions.size(); ++d) total->decisions[d] += weight * g.decisions[d];
  total->microbatches += weight * g.microbatches;
  total->hangs += weight * g.hangs;
  total->peak_bytes = std::max(total->peak_bytes, g.peak_bytes);
  for (size_t i = 0; i < g.step_seconds.size(); ++i) {
    total->step_seconds[i] = std::max(total->step_seconds[i], g.step_seconds[i]);
    total->step_gathered[i] = std::max(total->step_gathered[i], g.step_gathered[i]);
  }
}

double Mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

}  // namespace

PolicyEstimate EstimatePolicy(const PlanSetup& s, PlanPolicy policy) {
  const size_t steps = CountSteps(s.trace->keys);
  GroupTotals total;
  total.step_seconds.assign(steps, 0);
  total.step_gathered.assign(steps, 0);
  // Groups none of whose ranks the trace names decide alike: one of them stands for all.
  std::optional<GroupTotals> absent;
  int64_t absent_groups = 0;
  for (int g = 0; g < s.world_size / s.group_size; ++g) {
    if (GroupInTrace(*s.trace, g, s.group_size)) {
      Merge(SimulateGroup(s, policy, g, steps), 1, &total);
      continue;
    }
    if (!absent) absent = SimulateGroup(s, policy, g, steps);
    ++absent_groups;
  }
  if (absent) Merge(*absent, absent_groups, &total);
  PolicyEstimate e;
  e.policy = policy;
  e.decisions = total.decisions;
  e.group_microbatches = total.microbatches;
  e.hang_microbatches = total.hangs;
  e.steps = static_cast<int64_t>(steps);
  e.seconds_per_step = Mean(total.step_seconds);
  e.gathered_bytes_per_step = Mean(total.step_gathered);
  e.peak_bytes = total.peak_bytes;
  e.fits = s.budget_bytes <= 0 || e.peak_bytes <= s.budget_bytes;
  return e;
}

std::optional<size_t> BestSafePolicy(const std::vector<PolicyEstimate>& estimates) {
  std::optional<size_t> best;
  for (size_t i = 0; i < estimates.size(); ++i) {
    const PolicyEstimate& e = estimates[i];
    if (!e.safe() || !e.fits) continue;
    if (!best || e.seconds_per_step < estimates[*best].seconds_per_step ||
        (e.seconds_per_step == estimates[*best].seconds_per_step && e.peak_bytes < estimates[*best].peak_bytes)) {
      best = i;
    }
  }
  return best;
}

namespace {

// The world and group sizes from the options, the cost file and the trace; false (and one
// line on `err`) when they do not fit each other.
bool ResolveWorld(const Trace& trace, const CostFile& costs, const PlanOptions& o, std::ostream& err,
                  PlanSetup* s) {
  if (o.world_size <= 0 && int64_t{trace.max_rank} + 1 > kMaxReplayWorldSize) {
    err << "shardctl plan: the trace names rank " << trace.max_rank << "; a plan simulates at most "
        << kMaxReplayWorldSize << " ranks\n";
    return false;
  }
  s->world_size = o.world_size > 0 ? o.world_size : trace.max_rank + 1;
  if (trace.max_rank >= s->world_size) {
    err << "shardctl plan: the trace names rank " << trace.max_rank << " but --world-size is " << s->world_size
        << "\n";
    return false;
  }
  const bool from_costs = o.group_size <= 0 && costs.group_size > 0;
  s->group_size = o.group_size > 0 ? o.group_size : from_costs ? costs.group_size : s->world_size;
  if (s->world_size % s->group_size != 0) {
    err << "shardctl plan: group size " << s->group_size
        << (from_costs ? " (the cost file's group_size; give --group-size)" : "") << " does not divide world size "
        << s->world_size << "\n";
    return false;
  }
  if (costs.group_size > 0 && costs.group_size != s->group_size) {
    err << "shardctl plan: warning: " << o.cost_name << " was measured at group size " << costs.group_size
        << "; its gather times are used unchanged at group size " << s->group_size << "\n";
  }
  return true;
}

// The manifest's modules, checked against each other and the trace; false (and one line on
// `err`) on a duplicate, an oversized module, or a module the trace names that it lacks.
bool ResolveModules(const Trace& trace, const std::vector<ModuleSpec>& manifest, std::ostream& err,
                    PlanSetup* s) {
  std::set<std::string> names;
  for (const ModuleSpec& m : manifest) {
    if (m.name.empty() || !names.insert(m.name).second) {
      err << "shardctl plan: manifest module '" << m.name << "' is empty or given twice\n";
      return false;
    }
    if (m.param_bytes < 0 || m.param_bytes > kMaxPlanModuleBytes) {
      err << "shardctl plan: manifest module '" << m.name << "' has param_bytes " << m.param_bytes
          << "; the planner takes 0.." << kMaxPlanModuleBytes << "\n";
      return false;
    }
  }
  for (const std::string& name : trace.module_names) {
    if (!names.count(name)) {
      err << "shardctl plan: the trace names module '" << name << "' which is not in the manifest ["
          << absl::StrJoin(names, ", ") << "]\n";
      return false;
    }
  }
  s->modules = manifest;
  return true;
}

// False (and one line on `err`) when a line calls a module more often than the planner
// takes, or the trace is too sparse and wide to simulate in reasonable time.
bool CheckTraceBounds(const Trace& trace, int group_size, std::ostream& err) {
  std::set<int> groups;
  for (const auto& [rank, lines] : trace.plans) {
    groups.insert(rank / group_size);
    for (const auto& [key, calls] : lines) {
      for (const auto& [module, n] : calls) {
        if (n <= kMaxPlanCallsPerMicrobatch) continue;
        err << "shardctl plan: rank " << rank << " calls module '" << module << "' " << n << " times in "
            << key.ToString() << "; the planner takes at most " << kMaxPlanCallsPerMicrobatch << "\n";
        return false;
      }
    }
  }
  const int64_t work = static_cast<int64_t>(groups.size()) * static_cast<int64_t>(trace.keys.size());
  if (work > kMaxPlanGroupMicrobatches) {
    err << "shardctl plan: " << groups.size() << " groups x " << trace.keys.size() << " microbatches is over "
        << kMaxPlanGroupMicrobatches << " group microbatches; plan a shorter or narrower trace\n";
    return false;
  }
  return true;
}

// How the rest of a microbatch is priced (OtherSeconds): per token when the trace gives tokens
// and the cost file prices them, else per call; a warning when only one of them has tokens.
void ResolveOtherCosts(const Trace& trace, const CostFile& costs, const PlanOptions& o, std::ostream& err,
                       PlanSetup* s) {
  s->other_seconds_per_call.assign(s->modules.size(), 0);
  for (const CostFileModule& f : costs.modules) {
    for (size_t m = 0; m < s->modules.size(); ++m) {
      if (s->modules[m].name == f.cost.module) s->other_seconds_per_call[m] = f.other_seconds_per_call;
    }
  }
  const bool priced = costs.other_seconds_per_token.has_value();
  s->per_token = trace.has_tokens() && priced;
  s->other_seconds_per_token = costs.other_seconds_per_token.value_or(0);
  s->other_tokens_per_microbatch = costs.other_tokens_per_microbatch;
  if (trace.has_tokens() && !priced) {
    err << "shardctl plan: warning: " << o.trace_name << " gives tokens but " << o.cost_name
        << " has no other_seconds_per_token: the rest of each microbatch is priced per call (calibrate one with "
           "bench/policy_matrix.py --cost-out)\n";
  } else if (priced && !trace.has_tokens()) {
    err << "shardctl plan: warning: " << o.cost_name << " prices tokens but " << o.trace_name
        << " gives none: the rest of each microbatch is priced per call (write the trace with its tokens: "
           "bench/policy_matrix.py --trace-dir, scripts/make_trace.py --tokens)\n";
  }
}

std::optional<PlanSetup> ResolveSetup(const Trace& trace, const std::vector<ModuleSpec>& manifest,
                                      const CostFile& costs, const PlanOptions& o, std::ostream& err) {
  if (trace.keys.empty()) {
    err << "shardctl plan: " << o.trace_name << " holds no microbatch\n";
    return std::nullopt;
  }
  PlanSetup s;
  s.trace = &trace;
  s.other_seconds_per_microbatch = costs.other_seconds_per_microbatch;
  s.budget_bytes = o.budget_bytes;
  s.fallback = o.fallback;
  for (const std::string& w : costs.warnings) err << "shardctl plan: warning: " << w << "\n";
  if (!ResolveWorld(trace, costs, o, err, &s) || !ResolveModules(trace, manifest, err, &s) ||
      !CheckTraceBounds(trace, s.group_size, err)) {
    return std::nullopt;
  }
  std::vector<std::string> warnings;
  absl::StatusOr<std::vector<ModuleCostModel>> models = CostModelsFor(costs, manifest, o.cost_name, &warnings);
  for (const std::string& w : warnings) err << "shardctl plan: warning: " << w << "\n";
  if (!models.ok()) {
    err << "shardctl plan: " << models.status().message() << "\n";
    return std::nullopt;
  }
  s.costs = std::move(*models);
  s.most_calls.assign(s.modules.size(), 1);
  for (const auto& [rank, lines] : trace.plans) {
    for (const auto& [key, line] : lines) {
      for (size_t m = 0; m < s.modules.size(); ++m) {
        s.most_calls[m] = std::max(s.most_calls[m], CallsOf(&line, s.modules[m].name));
      }
    }
  }
  ResolveOtherCosts(trace, costs, o, err, &s);
  return s;
}

// "1000 B", "12.5 KiB", "600.0 MiB", "1.17 GiB".
std::string Bytes(double bytes) {
  if (bytes < 1024) return absl::StrFormat("%.0f B", bytes);
  if (bytes < 1024.0 * 1024) return absl::StrFormat("%.1f KiB", bytes / 1024);
  if (bytes < 1024.0 * 1024 * 1024) return absl::StrFormat("%.1f MiB", bytes / (1024.0 * 1024));
  return absl::StrFormat("%.2f GiB", bytes / (1024.0 * 1024 * 1024));
}

// "1 group", "3 groups"; "1 microbatch", "3 microbatches".
std::string Count(int64_t n, const std::string& noun) {
  const bool es = !noun.empty() && noun.back() == 'h';
  return absl::StrCat(n, " ", noun, n == 1 ? "" : es ? "es" : "s");
}

std::string Decided(const PolicyEstimate& e, Decision d) { return absl::StrCat(e.decisions[static_cast<size_t>(d)]); }

// The inputs, in one line above the table.
void PrintHeader(const PlanSetup& s, const PlanOptions& o, int64_t steps, std::ostream& out) {
  std::vector<std::string> modules;
  for (size_t m = 0; m < s.modules.size(); ++m) {
    modules.push_back(absl::StrFormat("%s %s (forward %.4f s/call, gather %.4f s)", s.modules[m].name,
                                      Bytes(static_cast<double>(s.modules[m].param_bytes)),
                                      s.costs[m].forward_seconds_per_call, s.costs[m].gather_seconds));
  }
  const std::string other =
      s.per_token ? absl::StrFormat("other %.4f s per microbatch of %d tokens, %.3g s per token more",
                                    s.other_seconds_per_microbatch, s.other_tokens_per_microbatch,
                                    s.other_seconds_per_token)
                  : absl::StrFormat("other %.4f s per microbatch", s.other_seconds_per_microbatch);
  out << absl::StrFormat("%s: %s in %s of %d, %s in %s; %s; %s; budget %s\n", o.trace_name,
                         Count(s.world_size, "rank"), Count(s.world_size / s.group_size, "group"), s.group_size,
                         Count(static_cast<int64_t>(s.trace->keys.size()), "microbatch"), Count(steps, "step"),
                         absl::StrJoin(modules, ", "), other,
                         s.budget_bytes > 0 ? Bytes(static_cast<double>(s.budget_bytes)) + " per rank" : "none");
}

std::string Note(const PolicyEstimate& e, bool best) {
  std::vector<std::string> notes;
  if (!e.safe()) notes.push_back("HANGS");
  if (!e.fits) notes.push_back("over budget");
  if (best) notes.push_back("best");
  return absl::StrJoin(notes, ", ");
}

void PrintTable(const PlanSetup& s, const PlanOptions& o, const std::vector<PolicyEstimate>& estimates,
                std::optional<size_t> best, std::ostream& out) {
  PrintHeader(s, o, estimates.front().steps, out);
  out << absl::StrFormat("%-12s %9s %7s %7s %9s %7s %7s %11s %11s %9s %8s  %s\n", "POLICY", "PER_LAYER", "SKIP",
                         "ROOT", "REPLICATE", "PADDED", "HANGS", "GATHER/STEP", "PEAK", "S/STEP", "VS_BEST", "NOTE");
  for (size_t i = 0; i < estimates.size(); ++i) {
    const PolicyEstimate& e = estimates[i];
    const std::string vs =
        !best ? "-" : absl::StrFormat("%+.1f%%", 100.0 * (e.seconds_per_step / estimates[*best].seconds_per_step - 1));
    std::string row = absl::StrFormat(
        "%-12s %9s %7s %7s %9s %7s %7d %11s %11s %9.4f %8s  %s", PlanPolicyName(e.policy),
        Decided(e, Decision::kPerLayer), Decided(e, Decision::kSkip), Decided(e, Decision::kRoot),
        Decided(e, Decision::kReplicate), Decided(e, Decision::kPadded),
        e.hang_microbatches, Bytes(e.gathered_bytes_per_step), Bytes(static_cast<double>(e.peak_bytes)),
        e.seconds_per_step, vs, Note(e, best && *best == i));
    absl::StripTrailingAsciiWhitespace(&row);
    out << row << "\n";
  }
  out << "PER_LAYER..PADDED: group decisions, each group, microbatch and module once; HANGS: group microbatches\n"
         "whose ranks would wait on each other forever; GATHER/STEP: bytes gathered per rank; PEAK: frozen bytes\n"
         "held at once per rank beyond its shards; S/STEP: estimated seconds (the slowest group; mean over steps)\n";
  if (!best) {
    out << "best safe policy: none (every policy estimated would hang or exceeds the budget)\n";
    return;
  }
  out << absl::StrFormat("best safe policy: %s (%.4f s per step, peak %s per rank)\n",
                         PlanPolicyName(estimates[*best].policy), estimates[*best].seconds_per_step,
                         Bytes(static_cast<double>(estimates[*best].peak_bytes)));
}

void PrintJson(const PlanSetup& s, const std::vector<PolicyEstimate>& estimates, std::optional<size_t> best,
               std::ostream& out) {
  for (size_t i = 0; i < estimates.size(); ++i) {
    const PolicyEstimate& e = estimates[i];
    nlohmann::ordered_json j;
    j["policy"] = PlanPolicyName(e.policy);
    j["safe"] = e.safe();
    j["fits"] = e.fits;
    j["best"] = best && *best == i;
    j["groups"] = s.world_size / s.group_size;
    j["group_size"] = s.group_size;
    j["steps"] = e.steps;
    j["group_microbatches"] = e.group_microbatches;
    for (Decision d : kDecisions) {
      j["decisions"][DecisionName(d)] = e.decisions[static_cast<size_t>(d)];
    }
    j["hang_microbatches"] = e.hang_microbatches;
    j["seconds_per_step"] = e.seconds_per_step;
    j["gathered_bytes_per_rank_per_step"] = e.gathered_bytes_per_step;
    j["peak_frozen_bytes_per_rank"] = e.peak_bytes;
    j["budget_bytes"] = s.budget_bytes;
    j["other_priced_by"] = s.per_token ? "tokens" : "calls";
    out << j.dump() << "\n";
  }
}

}  // namespace

int RunPlan(const Trace& trace, const std::vector<ModuleSpec>& manifest, const CostFile& costs,
            const PlanOptions& options, std::ostream& out, std::ostream& err) {
  const std::optional<PlanSetup> setup = ResolveSetup(trace, manifest, costs, options, err);
  if (!setup) return kPlanBadInput;
  if (options.policies.empty()) {
    err << "shardctl plan: no policy to estimate\n";
    return kPlanBadInput;
  }
  std::vector<PolicyEstimate> estimates;
  for (PlanPolicy p : options.policies) estimates.push_back(EstimatePolicy(*setup, p));
  const std::optional<size_t> best = BestSafePolicy(estimates);
  if (options.json) {
    PrintJson(*setup, estimates, best, out);
  } else {
    PrintTable(*setup, options, estimates, best, out);
  }
  return kPlanOk;
}

}  // namespace shardcoord::client
