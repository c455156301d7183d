#include "coordinator/core/job_table.h"

#include "absl/strings/str_cat.h"

namespace shardcoord::coordinator {

Job* JobTable::Find(const std::string& id) const {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

std::vector<const Job*> JobTable::Select(const std::string& id) const {
  std::vector<const Job*> out;
  if (!id.empty()) {
    if (const Job* job = Find(id)) out.push_back(job);
    return out;
  }
  for (const auto& [name, job] : jobs_) out.push_back(job.get());
  return out;
}

const SessionRef* JobTable::FindSession(uint64_t session_id) const {
  auto it = sessions_.find(session_id);
  return it == sessions_.end() ? nullptr : &it->second;
}

int64_t JobTable::TotalRanks() const {
  int64_t n = 0;
  for (const auto& [id, job] : jobs_) n += job->world_size;
  return n;
}

absl::Status JobTable::Admit(const std::string& job_id, int world_size, const CoordinatorLimits& lim,
                             std::vector<Forgotten>* forgotten) {
  while (static_cast<int>(jobs_.size()) >= lim.max_jobs || TotalRanks() + world_size > lim.max_total_ranks) {
    const Job* oldest = nullptr;
    for (const auto& [id, job] : jobs_) {
      if (job->has_ended() && (oldest == nullptr || job->ended < oldest->ended)) oldest = job.get();
    }
    if (oldest == nullptr) {
      const bool by_count = static_cast<int>(jobs_.size()) >= lim.max_jobs;
      return absl::ResourceExhaustedError(absl::StrCat(
          "register: cannot admit job '", job_id, "' (", world_size, " ranks): the coordinator holds ",
          by_count ? absl::StrCat("max_jobs (", lim.max_jobs, ") jobs")
                   : absl::StrCat(TotalRanks(), " ranks and max_total_ranks is ", lim.max_total_ranks),
          " and every job has live ranks; wait for a job to end or raise ",
          by_count ? "--max-jobs" : "--max-total-ranks"));
    }
    const std::string id = oldest->id;  // Erase destroys the job.
    forgotten->push_back({id, "evicted to admit a new job (max_jobs or max_total_ranks reached)"});
    Erase(id);
  }
  return absl::OkStatus();
}

Job& JobTable::Create(const std::string& id, int world_size, int group_size, const GroupRules& rules,
                      const std::string& run, BufferBudget* buffers) {
  const CoordinatorOptions& options = *rules.options;
  auto job = std::make_unique<Job>();
  job->id = id;
  job->world_size = world_size;
  job->group_size = group_size;
  job->run = run;
  job->run_auth = std::make_unique<const ResumeAuthority>(rules.auth->ForRun(id, run));
  GroupRules run_rules = rules;
  run_rules.auth = job->run_auth.get();
  const int groups = world_size / group_size;
  job->groups.reserve(groups);
  for (int g = 0; g < groups; ++g) {
    job->groups.push_back(std::make_unique<GroupSlot>(g, g * group_size, group_size, run_rules));
  }
  job->comms =
      std::make_unique<CommTable>(id, world_size, group_size, options.limits, options.behind_threshold, buffers);
  Job& created = *job;
  jobs_[id] = std::move(job);
  return created;
}

void JobTable::Erase(const std::string& id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  for (uint64_t session : it->second->sessions) sessions_.erase(session);
  jobs_.erase(it);
}

void JobTable::BindSession(uint64_t session_id, Job& job, int rank) {
  ForgetSession(session_id);
  sessions_[session_id] = SessionRef{&job, rank};
  job.sessions.insert(session_id);
}

void JobTable::ForgetSession(uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  it->second.job->sessions.erase(session_id);
  sessions_.erase(it);
}

std::vector<JobTable::Forgotten> JobTable::ForgetEnded(absl::Time now, absl::Duration retention) {
  std::vector<Forgotten> forgotten;
  for (const auto& [id, job] : jobs_) {
    if (!job->has_ended() || now - job->ended <= retention) continue;
    forgotten.push_back({id, absl::StrCat("no live rank for ", absl::ToInt64Milliseconds(now - job->ended),
                                          " ms (job retention ", absl::ToInt64Milliseconds(retention), " ms)")});
  }
  for (const Forgotten& f : forgotten) Erase(f.id);
  return forgotten;
}

}  // namespace shardcoord::coordinator
