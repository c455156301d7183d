// CoordinatorCore: the status views operators query (shardctl status, ranks,
// groups, decisions). Read-only snapshots taken under the core's lock.
#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/text.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"

namespace shardcoord::coordinator {
namespace {

// Largest answer to an operator's query (gRPC clients accept 4 MiB by default).
constexpr size_t kMaxAnswerBytes = 3 << 20;

}  // namespace

void CoordinatorCore::FillJobStatus(const Job& job, v1::JobStatus* js) const {
  js->set_job_id(job.id);
  js->set_world_size(job.world_size);
  js->set_group_size(job.group_size);
  js->set_plans_received(job.plans_received);
  js->set_microbatches_decided(job.microbatches_decided);
  for (const auto& slot : job.groups) {
    absl::MutexLock group_lock(&slot->mu);  // Its members and counts move on the hot path.
    CountGroup(slot->group, js);
  }
  // Communicators change under the exclusive lock only (their progress under their own).
  const auto left = [&](int rank) {
    GroupSlot& slot = SlotOf(job, rank);
    absl::MutexLock group_lock(&slot.mu);
    return slot.group.member(rank).state == v1::RANK_STATE_LEFT;
  };
  for (std::string& alert : job.comms->Alerts(left)) js->add_comm_alerts(std::move(alert));
}

void CoordinatorCore::CountGroup(const ShardGroup& g, v1::JobStatus* js) {
  for (const Member& m : g.members) {
    switch (m.state) {
      case v1::RANK_STATE_LIVE: js->set_ranks_live(js->ranks_live() + 1); break;
      case v1::RANK_STATE_DEAD: js->set_ranks_dead(js->ranks_dead() + 1); break;
      case v1::RANK_STATE_LEFT: js->set_ranks_left(js->ranks_left() + 1); break;
      default: js->set_ranks_unregistered(js->ranks_unregistered() + 1); break;
    }
  }
  switch (g.state) {
    case v1::GROUP_STATE_HEALTHY: js->set_groups_healthy(js->groups_healthy() + 1); break;
    case v1::GROUP_STATE_FAILED: js->set_groups_failed(js->groups_failed() + 1); break;
    case v1::GROUP_STATE_FINISHED: js->set_groups_finished(js->groups_finished() + 1); break;
    case v1::GROUP_STATE_RECOVERING: js->set_groups_recovering(js->groups_recovering() + 1); break;
    default: js->set_groups_forming(js->groups_forming() + 1); break;
  }
  for (const auto& [module, counts] : g.module_counts) AddDecisionCounts(counts, js->mutable_counts());
  if (g.has_reference && js->modules_size() == 0) {
    // A status line, not the manifest: a job may control a thousand modules.
    for (size_t i = 0; i < g.modules.size() && i < kNamesInMessages; ++i) js->add_modules(g.modules[i].name);
    if (g.modules.size() > kNamesInMessages) {
      js->add_modules(absl::StrCat("... (", g.modules.size() - kNamesInMessages, " more)"));
    }
  }
}

// The queries take the core's lock shared, as the hot path does, and each group's own mutex
// while they read it: an operator's query (or a Prometheus scrape) no longer stops every
// group's decisions for the time it takes to copy a large job (DESIGN 9).

v1::StatusResponse CoordinatorCore::Status(const std::string& job_id) const {
  absl::ReaderMutexLock lock(&mu_);
  v1::StatusResponse out;
  const absl::Time now = clock_->Now();
  out.set_version(shardcoord::kVersion);
  out.set_listen_address(bound_address_.empty() ? options_.listen_address : bound_address_);
  out.set_started_unix_ms(absl::ToUnixMillis(started_));
  out.set_uptime_ms(absl::ToInt64Milliseconds(now - started_));
  out.set_incarnation(incarnation_);
  for (const auto& [id, job] : jobs_) {
    if (!job_id.empty() && id != job_id) continue;
    FillJobStatus(*job, out.add_jobs());
    out.set_recovering_groups(out.recovering_groups() + out.jobs(out.jobs_size() - 1).groups_recovering());
  }
  return out;
}

v1::ListRanksResponse CoordinatorCore::Ranks(const std::string& job_id) const {
  absl::ReaderMutexLock lock(&mu_);
  v1::ListRanksResponse out;
  const absl::Time now = clock_->Now();
  for (const auto& [id, job] : jobs_) {
    if (!job_id.empty() && id != job_id) continue;
    for (const auto& slot : job->groups) {  // Groups are contiguous ranges: rank order is kept.
      absl::MutexLock group_lock(&slot->mu);
      const std::vector<int> pending = slot->group.PendingCounts();
      for (size_t i = 0; i < pending.size(); ++i) {
        FillRankStatus(id, slot->group.members[i], pending[i], now, out.add_ranks());
      }
    }
  }
  return out;
}

void CoordinatorCore::FillRankStatus(const std::string& id, const Member& m, int pending_plans, absl::Time now,
                                     v1::RankStatus* rs) const {
  rs->set_job_id(id);
  rs->set_rank(m.rank);
  rs->set_group(m.group);
  rs->set_state(m.state);
  rs->set_host(m.host);
  rs->set_pid(m.pid);
  rs->set_last_heartbeat_age_ms(m.last_seen == absl::InfinitePast()
                                    ? -1
                                    : absl::ToInt64Milliseconds(now - m.last_seen));
  if (m.last_planned) {
    ToProto(*m.last_planned, rs->mutable_last_planned());
  }
  rs->set_pending_plans(pending_plans);
  rs->set_plans_received(m.plans_received);
  rs->set_plans_rejected(m.plans_rejected);
  rs->set_dead_reason(m.dead_reason);
  rs->set_registrations(m.registrations);
  rs->set_decision_stalls(m.decision_stalls.total());
  rs->set_decision_stall_us(m.decision_stall_us.total());
  for (const auto& [module, t] : m.gathered_bytes) (*rs->mutable_gathered_bytes_total())[module] = t.total();
  for (const auto& mem : m.memory) *rs->add_memory() = mem;
}

void CoordinatorCore::FillGroupStatus(const Job& job, const ShardGroup& g, v1::GroupStatus* gs) const {
  gs->set_job_id(job.id);
  gs->set_group(g.index);
  for (int r : g.ranks) gs->add_ranks(r);
  gs->set_state(g.state);
  gs->set_epoch(g.epoch);
  gs->set_pending_microbatches(static_cast<int32_t>(g.pending.size()));
  for (const auto& [module, c] : g.module_counts) {
    (*gs->mutable_module_counts())[module] = c;
    AddDecisionCounts(c, gs->mutable_counts());
  }
  gs->set_failure_reason(g.failure_reason);
  if (g.engine) {
    gs->set_next_seq(g.engine->next_seq());
    for (const auto& name : g.engine->ReplicatedModules()) gs->add_promoted_modules(name);
    gs->set_policy(ToProto(g.engine->config().policy));
    gs->set_fallback(ToProto(g.engine->config().fallback));
  }
  if (g.last_decided) {
    ToProto(*g.last_decided, gs->mutable_last_decided());
  }
}

v1::ListGroupsResponse CoordinatorCore::Groups(const std::string& job_id) const {
  absl::ReaderMutexLock lock(&mu_);
  v1::ListGroupsResponse out;
  for (const auto& [id, job] : jobs_) {
    if (!job_id.empty() && id != job_id) continue;
    for (const auto& slot : job->groups) {
      absl::MutexLock group_lock(&slot->mu);
      FillGroupStatus(*job, slot->group, out.add_groups());
    }
  }
  return out;
}

v1::ListDecisionsResponse CoordinatorCore::Decisions(const std::string& job_id, int group,
                                                     int limit) const {
  absl::ReaderMutexLock lock(&mu_);
  v1::ListDecisionsResponse out;
  if (limit <= 0) limit = 20;
  // Every group of every job gives up to `limit`: the answer stops before it would outgrow
  // a message (ask per job or group for the rest).
  size_t bytes = 0;
  for (const auto& [id, job] : jobs_) {
    if (!job_id.empty() && id != job_id) continue;
    for (size_t gi = 0; gi < job->groups.size(); ++gi) {
      if (group >= 0 && static_cast<int>(gi) != group) continue;
      const GroupSlot& slot = *job->groups[gi];
      absl::MutexLock group_lock(&slot.mu);
      const ShardGroup& g = slot.group;
      size_t start = g.history.size() > static_cast<size_t>(limit) ? g.history.size() - limit : 0;
      for (size_t i = start; i < g.history.size(); ++i) {
        bytes += g.history[i].ByteSizeLong() + id.size() + 16;
        if (bytes > kMaxAnswerBytes) {
          out.set_truncated(true);
          return out;
        }
        auto* e = out.add_decisions();
        e->set_job_id(id);
        *e->mutable_decision() = g.history[i];
      }
    }
  }
  return out;
}

v1::ListCommsResponse CoordinatorCore::Comms(const std::string& job_id) const {
  absl::ReaderMutexLock lock(&mu_);  // Communicators change under the exclusive lock only.
  v1::ListCommsResponse out;
  for (const auto& [id, job] : jobs_) {
    if (!job_id.empty() && id != job_id) continue;
    job->comms->Fill(&out);
  }
  return out;
}

}  // namespace shardcoord::coordinator
