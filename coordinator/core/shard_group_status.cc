// ShardGroup: how the group describes itself to a rank that joins it (its RegisterResponse)
// and to operators (shardctl status, ranks, groups; the status page and /metrics read the same
// answers). Read-only; the caller holds the group.
#include "absl/strings/str_cat.h"
#include "coordinator/core/shard_group.h"
#include "coordinator/engine/text.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"

namespace shardcoord::coordinator {

v1::CoordinatorMessage ShardGroup::Registered(const Registration& req, uint64_t incarnation, uint64_t config_digest) const {
  v1::CoordinatorMessage msg;
  v1::RegisterResponse* resp = msg.mutable_registered();
  resp->set_group(index_);
  for (int r : ranks_) resp->add_group_ranks(r);
  resp->set_heartbeat_interval_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(rules_.options->heartbeat_interval)));
  resp->set_heartbeat_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(rules_.options->heartbeat_timeout)));
  resp->set_policy(ToProto(req.policy));
  resp->set_fallback(ToProto(req.fallback));
  resp->set_lookahead(req.lookahead);
  resp->set_coordinator_version(shardcoord::kVersion);
  resp->set_wire_revision(kWireRevision);
  // Deprecated: what workers built before bundles only look at (set while they may exist).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  resp->set_accepts_bundles(true);
#pragma GCC diagnostic pop
  if (req.policy == Policy::kPerLayer) {
    resp->add_warnings("policy per_layer: microbatches where ranks of the group diverge fall back to " +
                       std::string(FallbackName(req.fallback)) +
                       "; only uniform or all-skip microbatches shard per layer");
  }
  if (last_decided_) ToProto(*last_decided_, resp->mutable_last_decided());
  resp->set_incarnation(incarnation);
  resp->set_config_digest(config_digest);
  return msg;
}

void ShardGroup::CountInto(v1::JobStatus* js) const {
  for (const Member& m : members_) {
    switch (m.state) {
      case v1::RANK_STATE_LIVE: js->set_ranks_live(js->ranks_live() + 1); break;
      case v1::RANK_STATE_DEAD: js->set_ranks_dead(js->ranks_dead() + 1); break;
      case v1::RANK_STATE_LEFT: js->set_ranks_left(js->ranks_left() + 1); break;
      default: js->set_ranks_unregistered(js->ranks_unregistered() + 1); break;
    }
  }
  switch (state_) {
    case v1::GROUP_STATE_HEALTHY: js->set_groups_healthy(js->groups_healthy() + 1); break;
    case v1::GROUP_STATE_FAILED: js->set_groups_failed(js->groups_failed() + 1); break;
    case v1::GROUP_STATE_FINISHED: js->set_groups_finished(js->groups_finished() + 1); break;
    case v1::GROUP_STATE_RECOVERING: js->set_groups_recovering(js->groups_recovering() + 1); break;
    default: js->set_groups_forming(js->groups_forming() + 1); break;
  }
  for (const auto& [module, counts] : module_counts_) AddDecisionCounts(counts.ToProto(), js->mutable_counts());
  FillKinds(js->mutable_counts());
  if (has_reference_ && js->modules_size() == 0) {
    // A status line, not the manifest: a job may control a thousand modules.
    for (size_t i = 0; i < modules_.size() && i < kNamesInMessages; ++i) js->add_modules(modules_[i].name);
    if (modules_.size() > kNamesInMessages) {
      js->add_modules(absl::StrCat("... (", modules_.size() - kNamesInMessages, " more)"));
    }
    for (size_t i = 0; i < modules_.size() && i < kNamesInMessages; ++i) {
      if (modules_[i].trainable) js->add_trainable_modules(modules_[i].name);
    }
  }
}

void ShardGroup::Describe(v1::GroupStatus* gs) const {
  gs->set_job_id(rules_.job_id);
  gs->set_group(index_);
  for (int r : ranks_) gs->add_ranks(r);
  gs->set_state(state_);
  gs->set_epoch(epoch_);
  gs->set_pending_microbatches(static_cast<int32_t>(pending_.size()));
  for (const auto& [module, tally] : module_counts_) {
    v1::DecisionCounts& c = (*gs->mutable_module_counts())[module];
    c = tally.ToProto();
    AddDecisionCounts(c, gs->mutable_counts());
  }
  FillKinds(gs->mutable_counts());
  gs->set_failure_reason(failure_reason_);
  if (engine_) {
    gs->set_next_seq(engine_->next_seq());
    for (const auto& name : engine_->ReplicatedModules()) gs->add_promoted_modules(name);
    gs->set_policy(ToProto(engine_->config().policy));
    gs->set_fallback(ToProto(engine_->config().fallback));
  }
  if (last_decided_) ToProto(*last_decided_, gs->mutable_last_decided());
}

void ShardGroup::DescribeMembers(absl::Time now, google::protobuf::RepeatedPtrField<v1::RankStatus>* out) const {
  const std::vector<int> pending_plans = PendingCounts();
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    v1::RankStatus* rs = out->Add();
    rs->set_job_id(rules_.job_id);
    rs->set_rank(m.rank);
    rs->set_group(m.group);
    rs->set_state(m.state);
    rs->set_host(m.host);
    rs->set_pid(m.pid);
    rs->set_last_heartbeat_age_ms(m.last_seen == absl::InfinitePast() ? -1
                                                                       : absl::ToInt64Milliseconds(now - m.last_seen));
    if (m.last_planned) ToProto(*m.last_planned, rs->mutable_last_planned());
    rs->set_pending_plans(pending_plans[i]);
    rs->set_plans_received(m.plans_received);
    rs->set_plans_rejected(m.plans_rejected);
    rs->set_dead_reason(m.dead_reason);
    rs->set_registrations(m.registrations);
    rs->set_decision_stalls(m.decision_stalls.total());
    rs->set_decision_stall_us(m.decision_stall_us.total());
    for (const auto& [module, t] : m.gathered_bytes) (*rs->mutable_gathered_bytes_total())[module] = t.total();
    for (const ModuleMemoryUsage& mem : m.memory) ToProto(mem, rs->add_memory());
  }
}


bool ShardGroup::DescribeHistory(int limit, size_t max_bytes, size_t* bytes, v1::ListDecisionsResponse* out) const {
  const size_t start = history_.size() > static_cast<size_t>(limit) ? history_.size() - limit : 0;
  for (size_t i = start; i < history_.size(); ++i) {
    *bytes += history_[i].ByteSizeLong() + rules_.job_id.size() + 16;
    if (*bytes > max_bytes) return false;
    auto* e = out->add_decisions();
    e->set_job_id(rules_.job_id);
    *e->mutable_decision() = history_[i];
  }
  return true;
}

}  // namespace shardcoord::coordinator
