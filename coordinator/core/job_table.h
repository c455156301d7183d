// JobTable: the jobs a coordinator holds and the sessions that name their ranks.
//
// A job is created by its first rank's registration and holds its shard groups (GroupSlot,
// each behind its own mutex) and its communicators (CommTable). The table admits a new job
// under max_jobs and max_total_ranks, making room by forgetting the job that ended longest
// ago; it forgets a job once no rank was live for job_retention. It never touches a group's
// state. Not thread-safe: CoordinatorCore holds it under its mutex, exclusively to change it;
// its const methods (the hot path's FindSession, the queries) run side by side under a shared
// hold.
#ifndef SHARDCOORD_COORDINATOR_CORE_JOB_TABLE_H_
#define SHARDCOORD_COORDINATOR_CORE_JOB_TABLE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/core/comm_table.h"
#include "coordinator/core/shard_group.h"
#include "coordinator/settings/options.h"

namespace shardcoord::coordinator {

struct Job {
  std::string id;
  int world_size = 0;
  int group_size = 0;
  // This run of the job id (RegisterResponse.run_id) and the authority that makes its
  // credentials and seals (ResumeAuthority::ForRun); both new on a rerun (NewRun).
  std::string run;
  std::unique_ptr<const ResumeAuthority> run_auth;
  // Group g holds ranks [g * group_size, (g + 1) * group_size) and their Members.
  std::vector<std::unique_ptr<GroupSlot>> groups;
  std::unique_ptr<CommTable> comms;
  std::atomic<int64_t> plans_received{0};  // Counted by groups in parallel.
  std::atomic<int64_t> microbatches_decided{0};
  absl::Time ended = absl::InfinitePast();  // When its last live rank ended (retention).
  absl::Time started = absl::InfinitePast();  // Its first registration (or its rerun's): form_timeout.
  absl::flat_hash_set<uint64_t> sessions;  // Its entries in the JobTable's sessions (JobTable only).

  bool has_ended() const { return ended != absl::InfinitePast(); }
  int GroupOf(int rank) const { return rank / group_size; }
};

// A session's job and rank.
struct SessionRef {
  Job* job;
  int rank;
};

class JobTable {
 public:
  using Jobs = std::map<std::string, std::unique_ptr<Job>>;

  // A job forgotten to make room or after its retention, for the journal.
  struct Forgotten {
    std::string id;
    std::string why;
  };

  Job* Find(const std::string& id) const;
  // The job named `id`, or every job (in id order) when `id` is empty.
  std::vector<const Job*> Select(const std::string& id) const;
  // Makes room for a new job of `world_size` ranks by forgetting the ended jobs that ended
  // longest ago, while the table is full (`forgotten` says which). RESOURCE_EXHAUSTED, naming
  // the bound and the flag that raises it, when every job has live ranks.
  absl::Status Admit(const std::string& job_id, int world_size, const CoordinatorLimits& limits,
                     std::vector<Forgotten>* forgotten);
  // A new job of run `run` with its groups (each made with `rules`, sealing with the run's
  // authority derived from `rules.auth`) and its communicators (under `rules.options`' limits).
  // Its communicators' stores are charged to `buffers`.
  Job& Create(const std::string& id, int world_size, int group_size, const GroupRules& rules, const std::string& run,
              BufferBudget* buffers);
  // Forgets the job and its sessions.
  void Erase(const std::string& id);
  // Forgets the jobs with no live rank for longer than `retention`.
  std::vector<Forgotten> ForgetEnded(absl::Time now, absl::Duration retention);

  const SessionRef* FindSession(uint64_t session_id) const;
  void BindSession(uint64_t session_id, Job& job, int rank);
  void ForgetSession(uint64_t session_id);

  // Every job, in id order.
  Jobs::iterator begin() { return jobs_.begin(); }
  Jobs::iterator end() { return jobs_.end(); }
  Jobs::const_iterator begin() const { return jobs_.begin(); }
  Jobs::const_iterator end() const { return jobs_.end(); }

 private:
  int64_t TotalRanks() const;

  Jobs jobs_;
  absl::flat_hash_map<uint64_t, SessionRef> sessions_;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_JOB_TABLE_H_
