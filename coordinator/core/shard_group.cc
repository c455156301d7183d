#include "coordinator/core/shard_group.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/core/invariant.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {

void DecisionTally::Count(const v1::ModuleDecision& md) {
  if (const size_t i = DecisionIndex(FromProto(md.decision())); i < kNumDecisions) by_kind[i]++;
  if (md.reason() == v1::REASON_DIVERGENT) divergent++;
}

v1::DecisionCounts DecisionTally::ToProto() const {
  v1::DecisionCounts out;
  for (size_t i = 0; i < kNumDecisions; ++i) AddCount(kDecisions[i], by_kind[i], &out);
  out.set_divergent(divergent);
  return out;
}

ShardGroup::ShardGroup(int index, int first_rank, int size, GroupRules rules) : index_(index), rules_(std::move(rules)) {
  ranks_.reserve(size);
  members_.resize(size);
  bindings_.resize(size);
  for (int i = 0; i < size; ++i) {
    ranks_.push_back(first_rank + i);
    members_[i].rank = first_rank + i;
    members_[i].group = index_;
  }
}

ShardGroup::Census ShardGroup::Count() const {
  Census c;
  for (const Member& m : members_) {
    switch (m.state) {
      case v1::RANK_STATE_LIVE: c.live++; break;
      case v1::RANK_STATE_LEFT: c.left++; break;
      case v1::RANK_STATE_DEAD: c.dead++; break;
      default: break;
    }
  }
  return c;
}

int ShardGroup::PendingOf(int idx) const {
  int n = 0;
  for (const auto& [key, p] : pending_) n += p.reported[idx] ? 1 : 0;
  return n;
}

std::vector<int> ShardGroup::PendingCounts() const {
  std::vector<int> counts(members_.size(), 0);
  for (const auto& [key, p] : pending_) {
    for (size_t i = 0; i < counts.size(); ++i) counts[i] += p.reported[i] ? 1 : 0;
  }
  return counts;
}

void ShardGroup::SetReference(const Registration& req, const PromotionOptions& promotion) {
  has_reference_ = true;
  reference_ = req;  // What every member must match: not who sent it, nor what it resumed with.
  reference_.host.clear();
  reference_.pid = 0;
  reference_.resume.reset();
  reference_rank_ = req.rank;
  modules_.clear();
  module_index_.clear();
  for (const ModuleSpec& m : req.modules) {
    module_counts_[m.name];  // Every module's counts exist, at zero, from the start.
    module_index_[m.name] = static_cast<int>(modules_.size());
    modules_.push_back(m);
  }
  EngineConfig cfg;
  cfg.group = index_;
  cfg.policy = req.policy;
  cfg.fallback = req.fallback;
  cfg.modules = modules_;
  cfg.promotion = promotion;
  cfg.group_size = size();
  engine_ = std::make_unique<DecisionEngine>(std::move(cfg));
  // A new manifest (a rerun may bring one): what was measured against the old one is dropped.
  for (Member& m : members_) {
    m.costs.clear();
    m.frozen_budget = 0;
    m.costs_taken = absl::InfinitePast();
  }
  cost_model_.clear();
  RecomputeMeasured();
}

int64_t ShardGroup::SetPromotionBudget() {
  int64_t min_budget = INT64_MAX;
  for (const Member& m : members_) min_budget = std::min(min_budget, m.memory_budget);
  registered_budget_ = min_budget;
  const int64_t budget = EffectiveBudget();
  engine_->SetMinMemoryBudget(budget);
  return budget;
}

int64_t ShardGroup::EffectiveBudget() const {
  // 0 (no budget registered) disables promotion, measured or not; a measured room only lowers
  // a registered budget, once every member measured one.
  if (registered_budget_ <= 0 || budget_reporters_ < size()) return registered_budget_;
  return std::min(registered_budget_, measured_budget_);
}

namespace {

// Seconds a report may claim: finite, not negative, at most an hour (a hostile or broken
// worker cannot make the model say anything else).
bool GoodSeconds(double s) { return std::isfinite(s) && s >= 0 && s <= 3600; }

// One module's report as the group keeps it: forward, and the sum of at most one gather per
// layer unit of the manifest.
ModuleCostModel CostFromReport(const ModuleCost& r, const ModuleSpec& spec) {
  ModuleCostModel c;
  c.forward_seconds_per_call = GoodSeconds(r.forward_seconds_per_call) ? r.forward_seconds_per_call : 0;
  const size_t max_units = std::max<size_t>(spec.units.size(), 1);
  for (size_t i = 0; i < r.units.size() && i < max_units; ++i) {
    const UnitCost& u = r.units[i];
    if (GoodSeconds(u.gather_seconds) && u.gather_bytes >= 0) c.gather_seconds += u.gather_seconds;
  }
  if (!GoodSeconds(c.gather_seconds)) c.gather_seconds = 0;
  return c;
}

// More than a tenth apart (0 and 0 are not).
bool Moved(double before, double now) { return std::abs(now - before) > 0.1 * std::max(before, now); }

}  // namespace

std::string ShardGroup::TakeCosts(int idx, const HeartbeatReport& heartbeat, absl::Time now) {
  if (heartbeat.costs.empty() && heartbeat.frozen_budget_bytes <= 0) return "";
  Member& m = members_[idx];
  if (now < m.costs_taken + kMinCostReportSpacing) return "";  // Faster than any worker sends.
  m.costs_taken = now;
  if (!heartbeat.costs.empty()) {
    std::vector<ModuleCostModel> mine(modules_.size());
    std::vector<bool> seen(modules_.size(), false);
    for (const ModuleCost& r : heartbeat.costs) {
      auto it = module_index_.find(r.module);
      if (it == module_index_.end() || seen[it->second]) continue;
      seen[it->second] = true;
      mine[it->second] = CostFromReport(r, modules_[it->second]);
    }
    TakeMemberCosts(m, std::move(mine));
  }
  if (heartbeat.frozen_budget_bytes > 0) TakeMemberBudget(m, heartbeat.frozen_budget_bytes);
  return UpdateCostModel();
}

void ShardGroup::TakeMemberCosts(Member& m, std::vector<ModuleCostModel> mine) {
  measured_.resize(modules_.size());
  const std::vector<ModuleCostModel> old = std::move(m.costs);
  m.costs = std::move(mine);
  bool recompute = false;
  for (size_t i = 0; i < modules_.size(); ++i) {
    ModuleCostModel& max = measured_[i];
    const ModuleCostModel& now = m.costs[i];
    // A lowered maximum is found again among all members; a raised one is the new value.
    if (!old.empty() && (old[i].forward_seconds_per_call >= max.forward_seconds_per_call ||
                         old[i].gather_seconds >= max.gather_seconds)) {
      recompute = recompute || now.forward_seconds_per_call < old[i].forward_seconds_per_call ||
                  now.gather_seconds < old[i].gather_seconds;
    }
    max.forward_seconds_per_call = std::max(max.forward_seconds_per_call, now.forward_seconds_per_call);
    max.gather_seconds = std::max(max.gather_seconds, now.gather_seconds);
  }
  if (recompute) RecomputeMeasured();
}

void ShardGroup::TakeMemberBudget(Member& m, int64_t bytes) {
  const int64_t old = m.frozen_budget;
  m.frozen_budget = bytes;
  if (old <= 0) budget_reporters_++;
  if (bytes <= measured_budget_) {
    measured_budget_ = bytes;
  } else if (old == measured_budget_) {  // The smallest went up: find the smallest again.
    RecomputeMeasured();
  }
}

void ShardGroup::RecomputeMeasured() {
  measured_.assign(modules_.size(), ModuleCostModel{});
  measured_budget_ = INT64_MAX;
  budget_reporters_ = 0;
  for (const Member& m : members_) {
    for (size_t i = 0; i < m.costs.size() && i < measured_.size(); ++i) {
      measured_[i].forward_seconds_per_call = std::max(measured_[i].forward_seconds_per_call,
                                                      m.costs[i].forward_seconds_per_call);
      measured_[i].gather_seconds = std::max(measured_[i].gather_seconds, m.costs[i].gather_seconds);
    }
    if (m.frozen_budget > 0) {
      budget_reporters_++;
      measured_budget_ = std::min(measured_budget_, m.frozen_budget);
    }
  }
}

void ShardGroup::ForgetMeasures(int idx) {
  Member& m = members_[idx];
  if (m.costs.empty() && m.frozen_budget <= 0) return;
  m.costs.clear();
  m.frozen_budget = 0;
  m.costs_taken = absl::InfinitePast();
  RecomputeMeasured();
}

std::string ShardGroup::UpdateCostModel() {
  measured_.resize(modules_.size());
  const int64_t before = engine_->config().min_memory_budget_bytes;
  const int64_t budget = formed_ ? EffectiveBudget() : before;
  if (cost_model_.size() != modules_.size()) cost_model_.assign(modules_.size(), ModuleCostModel{});
  // A budget is a limit: any decrease applies at once; seconds (and raises) move by a tenth.
  bool moved = budget < before || Moved(static_cast<double>(before), static_cast<double>(budget));
  for (size_t i = 0; i < modules_.size() && !moved; ++i) {
    moved = Moved(cost_model_[i].forward_seconds_per_call, measured_[i].forward_seconds_per_call) ||
            Moved(cost_model_[i].gather_seconds, measured_[i].gather_seconds);
  }
  if (!moved) return "";
  cost_model_ = measured_;
  engine_->SetCosts(cost_model_);
  engine_->SetMinMemoryBudget(budget);
  std::string text;
  for (size_t i = 0; i < cost_model_.size(); ++i) {
    absl::StrAppend(&text, i ? "; " : "", "module '", modules_[i].name, "': ",
                    absl::StrFormat("forward %.4f s/call, gather %.4f s", cost_model_[i].forward_seconds_per_call,
                                    cost_model_[i].gather_seconds));
  }
  absl::StrAppend(&text, "; budget ", budget, " bytes (registered ", registered_budget_, ", ", budget_reporters_, " of ",
                  size(), " members measured one)");
  return text;
}

absl::StatusOr<ShardGroup::PlanCalls> ShardGroup::ParsePlan(const MicrobatchPlan& plan, const std::string& who) const {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("plan ", plan.key.ToString(), " from ", who, ": ", what));
  };
  if (std::string e = CheckPlanKey(plan.key); !e.empty()) return bad(e);
  PlanCalls calls;
  calls.reserve(plan.calls.size());
  for (const auto& [name, count] : plan.calls) {
    auto mi = module_index_.find(name);
    const bool known = mi != module_index_.end();
    std::vector<std::string> registered;
    if (!known) {
      for (const auto& spec : modules_) registered.push_back(spec.name);
    }
    if (std::string e = CheckPlanCall(name, count, known, registered); !e.empty()) return bad(e);
    calls.emplace_back(mi->second, count);
  }
  return calls;
}

absl::Status ShardGroup::CheckPendingRoom(const MicrobatchKey& key, const std::string& who, int max) const {
  if (static_cast<int>(pending_.size()) < max) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "plan ", key.ToString(), " from ", who, ": group ", index_, " already holds ", pending_.size(),
      " microbatches that some ranks reported and others not yet (max_pending_microbatches); the ranks of "
      "the group are too far apart: wait for the slowest, or raise --max-pending-microbatches"));
}

bool ShardGroup::Report(const MicrobatchKey& key, int idx, const PlanCalls& calls, absl::Time now) {
  auto [it, inserted] = pending_.try_emplace(key);
  PendingMicrobatch& p = it->second;
  if (inserted) {
    p.calls.assign(modules_.size(), std::vector<int32_t>(size(), 0));
    p.reported.assign(size(), false);
    p.first_report = now;
  }
  for (const auto& [mi, count] : calls) p.calls[mi][idx] = count;
  if (!p.reported[idx]) {  // A rank that left and came back may report a pending key again.
    p.reported[idx] = true;
    p.num_reported++;
  }
  members_[idx].last_planned = key;
  members_[idx].plans_received++;
  return inserted;
}

void ShardGroup::Resolve(std::map<MicrobatchKey, PendingMicrobatch>::iterator it) {
  if (!last_resolved_ || *last_resolved_ < it->first) last_resolved_ = it->first;
  pending_.erase(it);
}

void ShardGroup::RecordDecision(const v1::MicrobatchDecision& d, int keep) {
  for (const auto& md : d.modules()) module_counts_[md.module()].Count(md);
  last_decided_ = KeyOf(d);
  history_.push_back(d);
  while (static_cast<int>(history_.size()) > keep) history_.pop_front();
}

void ShardGroup::RestartKeys() {
  pending_.clear();
  last_resolved_.reset();
  last_drained_.reset();
  for (Member& m : members_) m.last_planned.reset();
}

void ShardGroup::TrimHistory(size_t keep) {
  while (history_.size() > keep) history_.pop_front();
  history_.shrink_to_fit();
}

}  // namespace shardcoord::coordinator
