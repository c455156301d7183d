#include "coordinator/engine/decision_engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardcoord::coordinator {

DecisionEngine::DecisionEngine(EngineConfig config)
    : config_(std::move(config)), state_(config_.modules.size()) {}

MicrobatchDecision DecisionEngine::NextDecision(const MicrobatchKey& key, int64_t epoch) {
  MicrobatchDecision d;
  d.group = config_.group;
  d.key = key;
  d.seq = next_seq_++;
  d.epoch = epoch;
  d.modules.reserve(config_.modules.size());
  return d;
}

MicrobatchDecision DecisionEngine::Decide(const MicrobatchKey& key, int64_t epoch,
                                          const std::vector<std::vector<int32_t>>& calls,
                                          std::vector<EngineTransition>* transitions) {
  MicrobatchDecision d = NextDecision(key, epoch);
  for (size_t m = 0; m < config_.modules.size(); ++m) {
    d.modules.push_back(DecideModule(m, calls[m], key, transitions));
  }
  d.digest = DecisionDigest(d);
  return d;
}

ModuleDecision DecisionEngine::DecideModule(size_t m, const std::vector<int32_t>& calls, const MicrobatchKey& key,
                                            std::vector<EngineTransition>* transitions) {
  const ModuleSpec& spec = config_.modules[m];
  ModuleState& st = state_[m];
  RuleOutcome rule = ApplyContract(config_.policy, config_.fallback, calls);
  if (spec.trainable) rule = ForTrainable(m, rule, key, transitions);
  const bool divergent = rule.reason == DecisionReason::kDivergent;
  const bool by_cost = config_.policy == Policy::kAuto && config_.promotion.by_cost && CostKnown(m);

  ModuleDecision md{spec.name, rule.decision, rule.reason, rule.calls};
  if (st.sticky_replicate) {
    md = {spec.name, Decision::kReplicate, DecisionReason::kStickyReplicate};
  } else if (st.promoted) {
    md = {spec.name, Decision::kReplicate, DecisionReason::kPromoted};
  } else if (divergent && config_.fallback == Fallback::kReplicate && !spec.trainable) {
    // This microbatch already gets `replicate` (reason divergent); later ones stay.
    st.sticky_replicate = true;
    if (transitions) {
      transitions->push_back({spec.name, "sticky_replicate",
                              absl::StrCat("ranks diverged at ", key.ToString(),
                                           "; fallback replicate keeps the module replicated "
                                           "from now on")});
    }
  } else if (by_cost) {
    ChooseByCostInto(m, calls, rule, &md, key, transitions);
  }
  if (by_cost) {
    UpdatePromotionByCost(m, calls, key, transitions);
  } else {
    UpdatePromotion(spec, st, rule.decision, key, transitions);
  }
  return md;
}

CostInputs DecisionEngine::CostInputsOf(size_t m) const {
  CostInputs in;
  in.spec = &config_.modules[m];
  if (m < config_.costs.size()) in.cost = config_.costs[m];
  in.group_size = config_.group_size;
  in.budget_bytes = config_.min_memory_budget_bytes;
  in.replica_resident = state_[m].promoted || state_[m].sticky_replicate;
  in.can_pad = config_.fallback == Fallback::kPadded && !config_.modules[m].trainable;
  return in;
}

RuleOutcome DecisionEngine::ForTrainable(size_t m, RuleOutcome rule, const MicrobatchKey& key,
                                         std::vector<EngineTransition>* transitions) {
  if (rule.decision != Decision::kReplicate && rule.decision != Decision::kPadded) return rule;
  ModuleState& st = state_[m];
  if (!st.trainable_said && transitions) {
    st.trainable_said = true;
    transitions->push_back({config_.modules[m].name, "trainable_root",
                            absl::StrCat("root instead of ", DecisionName(rule.decision), " from ", key.ToString(),
                                         " on (said once): the module has trainable parameters, so its backward "
                                         "issues collectives too, and only skip, per_layer and root give every "
                                         "rank the same ones")});
  }
  return {Decision::kRoot, rule.reason, 0};
}

void DecisionEngine::ChooseByCostInto(size_t m, const std::vector<int32_t>& calls, const RuleOutcome& rule,
                                      ModuleDecision* md, const MicrobatchKey& key,
                                      std::vector<EngineTransition>* transitions) {
  const CostInputs in = CostInputsOf(m);
  const CostChoice choice = ChooseByCost(in, calls);
  const Decision chosen = choice.chosen.decision;
  const bool overrides = chosen != rule.decision || choice.over_budget;
  const int32_t most = calls.empty() ? 0 : *std::max_element(calls.begin(), calls.end());
  if (chosen != rule.decision) {
    md->decision = chosen;
    md->reason = DecisionReason::kCost;
    md->calls = chosen == Decision::kPadded ? most : 0;
  }
  if (!overrides) return;
  ModuleState& st = state_[m];
  if (!st.announced.insert({rule.decision, chosen, choice.over_budget}).second || !transitions) return;
  transitions->push_back({config_.modules[m].name, "cost_choice",
                          absl::StrCat(DecisionName(chosen), " instead of ", DecisionName(rule.decision),
                                       " from ", key.ToString(), " on (said once per model): ",
                                       DescribeChoice(choice, in, most))});
}

void DecisionEngine::UpdatePromotionByCost(size_t m, const std::vector<int32_t>& calls, const MicrobatchKey& key,
                                           std::vector<EngineTransition>* transitions) {
  const ModuleSpec& spec = config_.modules[m];
  ModuleState& st = state_[m];
  const CostInputs in = CostInputsOf(m);
  const double saving = ReplicaSaving(in, calls);
  st.recent_savings.push_back(saving);
  st.savings_in_window += saving;
  if (static_cast<int>(st.recent_savings.size()) > config_.promotion.window) {
    st.savings_in_window -= st.recent_savings.front();
    st.recent_savings.pop_front();
  }
  const double build = in.cost.gather_seconds;  // Making a replica gathers the module once.
  const double kEpsilon = 1e-9;                  // Sums of measured seconds: no exact equality.
  // A trainable module is never replicated (its replica would be stale after each optimizer step).
  const bool fits = config_.min_memory_budget_bytes > 0 && spec.param_bytes <= config_.min_memory_budget_bytes &&
                    !spec.trainable;
  const bool full = static_cast<int>(st.recent_savings.size()) == config_.promotion.window;
  // The numbers that decided, formatted only for a transition (not on every decision).
  auto window = [&] {
    return absl::StrFormat(
        "a replica would have saved %.4f s over the last %d microbatches (building one: %.4f s); "
        "%d bytes against the budget of %d",
        st.savings_in_window, static_cast<int>(st.recent_savings.size()), build, spec.param_bytes,
        config_.min_memory_budget_bytes);
  };
  if (!st.promoted && !st.sticky_replicate && fits && build > 0 && st.savings_in_window >= build - kEpsilon) {
    st.promoted = true;
    if (transitions) {
      transitions->push_back({spec.name, "promoted",
                              absl::StrCat("by cost: ", window(), "; replicated from the microbatch after ",
                                           key.ToString())});
    }
  } else if (st.promoted && (!fits || (full && (st.savings_in_window < build - kEpsilon ||
                                                   st.savings_in_window <= kEpsilon)))) {
    // No longer fits, or a full window saved less than a rebuild would cost, or nothing at all
    // (a group of one gathers nothing: a replica there only holds memory).
    st.promoted = false;
    if (transitions) {
      transitions->push_back({spec.name, "demoted",
                              absl::StrCat("by cost: ", fits ? "" : "it no longer fits; ", window(),
                                           "; decided per microbatch again after ", key.ToString())});
    }
  }
}

void DecisionEngine::SetCosts(std::vector<ModuleCostModel> costs) {
  config_.costs = std::move(costs);
  for (ModuleState& st : state_) st.announced.clear();  // A new model: its choices are news.
}

void DecisionEngine::UpdatePromotion(const ModuleSpec& spec, ModuleState& st, Decision rule_decision,
                                     const MicrobatchKey& key, std::vector<EngineTransition>* transitions) {
  const PromotionOptions& promo = config_.promotion;
  // The history counts microbatches in which the contract would gather the module
  // (per_layer, root or padded: some rank runs it), whatever was decided. A replica saves the whole
  // gather in each of them, not only in divergent ones: on 2 x H200 with a 0.63 B tower,
  // replicate was 15 % faster than per_layer even when every rank had images
  // (docs/GPU.md, the policy matrix).
  const bool gathers = rule_decision == Decision::kPerLayer || rule_decision == Decision::kRoot ||
                       rule_decision == Decision::kPadded;
  st.recent_gathers.push_back(gathers);
  st.gathers_in_window += gathers ? 1 : 0;
  if (static_cast<int>(st.recent_gathers.size()) > promo.window) {
    st.gathers_in_window -= st.recent_gathers.front() ? 1 : 0;
    st.recent_gathers.pop_front();
  }

  const bool can_promote = config_.policy == Policy::kAuto && !st.sticky_replicate && !spec.trainable &&
                           config_.min_memory_budget_bytes > 0 &&
                           spec.param_bytes <= config_.min_memory_budget_bytes;
  if (can_promote && !st.promoted && st.gathers_in_window >= promo.promote_threshold) {
    st.promoted = true;
    if (transitions) {
      transitions->push_back(
          {spec.name, "promoted",
           absl::StrCat(st.gathers_in_window, " of the last ", st.recent_gathers.size(),
                        " microbatches gathered it (threshold ", promo.promote_threshold,
                        "); replicated from the microbatch after ", key.ToString(), " (",
                        spec.param_bytes, " bytes fit every rank's budget of ",
                        config_.min_memory_budget_bytes, ")")});
    }
  } else if (st.promoted && static_cast<int>(st.recent_gathers.size()) == promo.window &&
             st.gathers_in_window <= promo.demote_threshold) {
    st.promoted = false;
    if (transitions) {
      transitions->push_back(
          {spec.name, "demoted",
           absl::StrCat(st.gathers_in_window, " of the last ", promo.window,
                        " microbatches gathered it; decided per microbatch again after ",
                        key.ToString())});
    }
  }
}

MicrobatchDecision DecisionEngine::DecideStatic(const MicrobatchKey& key, int64_t epoch,
                                                std::vector<EngineTransition>* transitions) {
  MicrobatchDecision d = NextDecision(key, epoch);
  static const std::vector<int32_t> kNoCalls;
  for (size_t m = 0; m < config_.modules.size(); ++m) {
    const ModuleSpec& spec = config_.modules[m];
    RuleOutcome rule = ApplyContract(config_.policy, config_.fallback, kNoCalls);
    if (spec.trainable) rule = ForTrainable(m, rule, key, transitions);
    d.modules.push_back({spec.name, rule.decision, rule.reason});
  }
  d.digest = DecisionDigest(d);
  return d;
}

std::vector<std::string> DecisionEngine::ReplicatedModules() const {
  std::vector<std::string> out;
  for (size_t m = 0; m < state_.size(); ++m) {
    if (state_[m].sticky_replicate || state_[m].promoted) out.push_back(config_.modules[m].name);
  }
  return out;
}

void DecisionEngine::Restore(uint64_t next_seq, const std::set<std::string>& promoted,
                             const std::set<std::string>& sticky) {
  next_seq_ = std::max(next_seq_, next_seq);
  for (size_t i = 0; i < config_.modules.size(); ++i) {
    state_[i].promoted = promoted.count(config_.modules[i].name) > 0;
    state_[i].sticky_replicate = sticky.count(config_.modules[i].name) > 0;
  }
}

}  // namespace shardcoord::coordinator
