// DecisionEngine: the deterministic per-group decision state machine (DESIGN 3).
//
// Given the calls every member of a shard group will make in a microbatch, it returns the
// one decision all members receive. On top of the pure rule (ApplyContract) it keeps the
// only state the contract has: sticky replication after a divergence with fallback
// `replicate`, and `auto` promotion to `replicate`. Decisions are a deterministic function of
// the sequence of plans, the config (its cost model included) and this state, so the same
// inputs give the same decisions in any process.
//
// `auto` decides a module in one of two ways (DESIGN 3):
// - by counting, while nothing is measured: the contract's rule, and promotion to replicate
//   when `promote_threshold` of the last `window` microbatches gathered it (PromotionOptions);
// - by cost, once the group's members reported what the module costs (shardcoord/cost.h):
//   each microbatch the cheapest safe placement that fits the budget (per_layer or root when
//   every rank runs the module: root when it runs more than once and gathering once is
//   cheaper; with fallback `padded`, padded for divergent calls when the whole module does not
//   fit), and a replica when the time it saved over the last `window` microbatches would
//   have paid for building it; demoted when it no longer would, or no longer fits.
//
// A trainable module (ModuleSpec::trainable) is decided skip, per_layer or root only: where the
// policy, the fallback, promotion or cost would choose replicate or padded, it gets root (the
// first time said in a "trainable_root" transition). Its backward issues collectives too, and
// only those three give every rank the same ones (DESIGN 10, "Towers that train").
//
// Not thread-safe: the owner (the coordinator's group state) serializes calls.
#ifndef SHARDCOORD_COORDINATOR_ENGINE_DECISION_ENGINE_H_
#define SHARDCOORD_COORDINATOR_ENGINE_DECISION_ENGINE_H_

#include <cstdint>
#include <deque>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "coordinator/settings/options.h"
#include "shardcoord/cost.h"
#include "shardcoord/decide.h"
#include "shardcoord/types.h"

namespace shardcoord::coordinator {

struct EngineConfig {
  int32_t group = 0;
  Policy policy = Policy::kAuto;        // Resolved.
  Fallback fallback = Fallback::kRoot;  // Resolved.
  std::vector<ModuleSpec> modules;      // Manifest order = decision order.
  PromotionOptions promotion;
  // Smallest memory budget any member reported; 0 disables promotion.
  int64_t min_memory_budget_bytes = 0;
  int32_t group_size = 1;
  // The group's measured cost per module (manifest order; empty or unknown entries: the
  // module is decided by counting).
  std::vector<ModuleCostModel> costs;
};

// A change of a module's state, for the event journal.
struct EngineTransition {
  std::string module;
  std::string what;  // "sticky_replicate", "promoted", "demoted" or "cost_choice".
  std::string detail;
};

class DecisionEngine {
 public:
  explicit DecisionEngine(EngineConfig config);

  const EngineConfig& config() const { return config_; }
  bool is_static() const { return IsStaticPolicy(config_.policy); }

  // Decides the group's next microbatch. `calls[m][i]` is how many times member i (in
  // group order) calls module m (manifest order). Must be called in increasing key order;
  // assigns seq 0, 1, 2, ... Appends state changes that take effect from the next
  // microbatch to `transitions` when non-null.
  MicrobatchDecision Decide(const MicrobatchKey& key, int64_t epoch,
                            const std::vector<std::vector<int32_t>>& calls,
                            std::vector<EngineTransition>* transitions = nullptr);

  // The decision for a static policy (root / replicate), which needs no plans: made once
  // per key, when the first rank of the group reports it, so that every rank gets the same.
  // Takes the next seq, like Decide: one sequence for every policy, going on across epochs.
  // A trainable module under policy `replicate` gets root, said once in `transitions`.
  MicrobatchDecision DecideStatic(const MicrobatchKey& key, int64_t epoch,
                                  std::vector<EngineTransition>* transitions = nullptr);

  uint64_t next_seq() const { return next_seq_; }
  // The smallest memory budget of the group's members, once known (promotion needs it).
  void SetMinMemoryBudget(int64_t bytes) { config_.min_memory_budget_bytes = bytes; }
  // The group's measured costs (manifest order; shorter: the rest unknown). Takes effect
  // from the next microbatch decided.
  void SetCosts(std::vector<ModuleCostModel> costs);
  // After a coordinator restart (DESIGN 12): seq goes on from `next_seq`, and the modules
  // the last decision replicated by promotion or sticky fallback stay so. Promotion's
  // window of recent microbatches starts empty.
  void Restore(uint64_t next_seq, const std::set<std::string>& promoted, const std::set<std::string>& sticky);
  // Modules currently replicated by promotion or sticky fallback.
  std::vector<std::string> ReplicatedModules() const;

 private:
  struct ModuleState {
    bool sticky_replicate = false;
    bool promoted = false;
    std::deque<bool> recent_gathers;  // Last `promotion.window` microbatches: did the contract gather?
    int gathers_in_window = 0;
    std::deque<double> recent_savings;  // Cost mode: seconds a replica would have saved.
    double savings_in_window = 0;
    // Cost mode: the overrides (rule's decision, chosen, over budget) said in an event since
    // the model last changed; each is said once, so alternating shapes do not flood the journal.
    std::set<std::tuple<Decision, Decision, bool>> announced;
    bool trainable_said = false;  // The first root instead of replicate / padded was said.
  };

  // An empty decision for the group's next seq (Decide and DecideStatic fill its modules).
  MicrobatchDecision NextDecision(const MicrobatchKey& key, int64_t epoch);
  CostInputs CostInputsOf(size_t m) const;
  bool CostKnown(size_t m) const { return m < config_.costs.size() && config_.costs[m].Known(); }
  // One module's decision, and the sticky state a divergence with fallback replicate sets.
  ModuleDecision DecideModule(size_t m, const std::vector<int32_t>& calls, const MicrobatchKey& key,
                              std::vector<EngineTransition>* transitions);
  // A trainable module's outcome: root instead of replicate or padded.
  RuleOutcome ForTrainable(size_t m, RuleOutcome rule, const MicrobatchKey& key,
                           std::vector<EngineTransition>* transitions);
  // Cost mode: the cheapest safe placement that fits instead of the rule's, with a
  // "cost_choice" transition the first time each kind of override happens under a model.
  void ChooseByCostInto(size_t m, const std::vector<int32_t>& calls, const RuleOutcome& rule,
                        ModuleDecision* md, const MicrobatchKey& key, std::vector<EngineTransition>* transitions);
  // Cost mode's promotion and demotion (the same rule as every other choice: time, within
  // the budget).
  void UpdatePromotionByCost(size_t m, const std::vector<int32_t>& calls, const MicrobatchKey& key,
                             std::vector<EngineTransition>* transitions);

  // `auto` promotion (DESIGN 3): counts the microbatches the contract would gather and
  // promotes or demotes the module, recording the transition.
  void UpdatePromotion(const ModuleSpec& spec, ModuleState& st, Decision rule_decision, const MicrobatchKey& key,
                       std::vector<EngineTransition>* transitions);

  EngineConfig config_;
  std::vector<ModuleState> state_;  // Parallel to config_.modules.
  uint64_t next_seq_ = 0;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_ENGINE_DECISION_ENGINE_H_
