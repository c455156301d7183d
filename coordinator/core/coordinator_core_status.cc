// CoordinatorCore: the status views operators query (shardctl status, ranks, groups,
// decisions, comms). Read-only snapshots under the core's lock held shared, plus each group's
// own mutex in turn (communicators change only under the lock held exclusively).
#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/engine/text.h"
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
    GroupLock group_lock(&slot->mu);  // Its members and counts move on the hot path.
    slot->group.CountInto(js);
  }
  // Communicators change under the exclusive lock only (their progress under their own).
  const auto left = [&](int rank) {
    GroupSlot& slot = SlotOf(job, rank);
    GroupLock group_lock(&slot.mu);
    return slot.group.member(rank).state == v1::RANK_STATE_LEFT;
  };
  for (std::string& alert : job.comms->Alerts(left)) js->add_comm_alerts(std::move(alert));
}

// The queries take the core's lock shared, as the hot path does, and each group's own mutex
// while they read it: an operator's query (or a Prometheus scrape) no longer stops every
// group's decisions for the time it takes to copy a large job (DESIGN 9).

v1::StatusResponse CoordinatorCore::Status(const std::string& job_id) const {
  CoreReaderLock lock(&mu_);
  v1::StatusResponse out;
  const absl::Time now = clock_->Now();
  out.set_version(shardcoord::kVersion);
  out.set_listen_address(bound_address_.empty() ? options_.listen_address : bound_address_);
  out.set_started_unix_ms(absl::ToUnixMillis(started_));
  out.set_uptime_ms(absl::ToInt64Milliseconds(now - started_));
  out.set_incarnation(incarnation_);
  for (const Job* job : jobs_.Select(job_id)) {
    FillJobStatus(*job, out.add_jobs());
    out.set_recovering_groups(out.recovering_groups() + out.jobs(out.jobs_size() - 1).groups_recovering());
  }
  return out;
}

v1::ListRanksResponse CoordinatorCore::Ranks(const std::string& job_id) const {
  CoreReaderLock lock(&mu_);
  v1::ListRanksResponse out;
  const absl::Time now = clock_->Now();
  for (const Job* job : jobs_.Select(job_id)) {
    for (const auto& slot : job->groups) {  // Groups are contiguous ranges: rank order is kept.
      GroupLock group_lock(&slot->mu);
      slot->group.DescribeMembers(now, out.mutable_ranks());
    }
  }
  return out;
}

v1::ListGroupsResponse CoordinatorCore::Groups(const std::string& job_id) const {
  CoreReaderLock lock(&mu_);
  v1::ListGroupsResponse out;
  for (const Job* job : jobs_.Select(job_id)) {
    for (const auto& slot : job->groups) {
      GroupLock group_lock(&slot->mu);
      slot->group.Describe(out.add_groups());
    }
  }
  return out;
}

v1::ListDecisionsResponse CoordinatorCore::Decisions(const std::string& job_id, int group,
                                                     int limit) const {
  CoreReaderLock lock(&mu_);
  v1::ListDecisionsResponse out;
  if (limit <= 0) limit = 20;
  // Every group of every job gives up to `limit`: the answer stops before it would outgrow
  // a message (ask per job or group for the rest).
  size_t bytes = 0;
  for (const Job* job : jobs_.Select(job_id)) {
    for (size_t gi = 0; gi < job->groups.size(); ++gi) {
      if (group >= 0 && static_cast<int>(gi) != group) continue;
      const GroupSlot& slot = *job->groups[gi];
      GroupLock group_lock(&slot.mu);
      if (!slot.group.DescribeHistory(limit, kMaxAnswerBytes, &bytes, &out)) {
        out.set_truncated(true);
        return out;
      }
    }
  }
  return out;
}

v1::ListCommsResponse CoordinatorCore::Comms(const std::string& job_id) const {
  CoreReaderLock lock(&mu_);  // Communicators change under the exclusive lock only.
  v1::ListCommsResponse out;
  for (const Job* job : jobs_.Select(job_id)) job->comms->Fill(&out);
  return out;
}

}  // namespace shardcoord::coordinator
