// CoordinatorCore, part 1: registration, groups, plans and decisions, liveness (DESIGN 3, 8).
#include "coordinator_core.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "registration.h"
#include "text.h"

namespace shardcoord::coordinator {
namespace {

// Decisions an ended job keeps per group (a live one keeps `decision_history`).
constexpr size_t kEndedJobHistory = 16;

}  // namespace

CoordinatorCore::CoordinatorCore(CoordinatorOptions options, std::shared_ptr<const Clock> clock)
    : options_(std::move(options)),
      clock_(std::move(clock)),
      started_(clock_->Now()),
      journal_(options_.event_capacity) {}

CoordinatorCore::~CoordinatorCore() = default;

void CoordinatorCore::Event(const std::string& severity, const std::string& kind,
                            const std::string& job, int rank, int group,
                            const std::string& message) {
  journal_.Add(clock_->Now(), severity, kind, job, rank, group, message);
}

// ----------------------------------------------------------------------------------------
// Registration

void CoordinatorCore::SetReference(Group& group, const v1::RegisterRequest& req) {
  group.has_reference = true;
  group.reference = req;
  group.reference.clear_host();
  group.reference.clear_pid();
  group.reference_rank = req.rank();
  group.modules.clear();
  group.module_index.clear();
  for (const auto& m : req.modules()) {
    group.module_index[m.name()] = static_cast<int>(group.modules.size());
    group.modules.push_back(FromProto(m));
  }
  EngineConfig cfg;
  cfg.group = group.index;
  cfg.policy = FromProto(req.policy());
  cfg.fallback = FromProto(req.fallback());
  cfg.modules = group.modules;
  cfg.promotion = options_.promotion;
  group.engine = std::make_unique<DecisionEngine>(std::move(cfg));
}

absl::Status CoordinatorCore::AdmitJob(const std::string& job_id, int world_size) {
  const CoordinatorLimits& lim = options_.limits;
  auto total_ranks = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int64_t n = 0;
    for (const auto& [id, job] : jobs_) n += job->world_size;
    return n;
  };
  // Full: make room by forgetting the jobs that ended longest ago, while any ended.
  while (static_cast<int>(jobs_.size()) >= lim.max_jobs || total_ranks() + world_size > lim.max_total_ranks) {
    auto oldest = jobs_.end();
    for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
      if (it->second->ended == absl::InfinitePast()) continue;
      if (oldest == jobs_.end() || it->second->ended < oldest->second->ended) oldest = it;
    }
    if (oldest == jobs_.end()) {
      const bool by_count = static_cast<int>(jobs_.size()) >= lim.max_jobs;
      return absl::ResourceExhaustedError(absl::StrCat(
          "register: cannot admit job '", job_id, "' (", world_size, " ranks): the coordinator holds ",
          by_count ? absl::StrCat("max_jobs (", lim.max_jobs, ") jobs")
                   : absl::StrCat(total_ranks(), " ranks and max_total_ranks is ", lim.max_total_ranks),
          " and every job has live ranks; wait for a job to end or raise ",
          by_count ? "--max-jobs" : "--max-total-ranks"));
    }
    Event("info", "job_evicted", oldest->first, -1, -1, "evicted to admit a new job (max_jobs or max_total_ranks reached)");
    for (const Member& m : oldest->second->members) sessions_.erase(m.session);
    jobs_.erase(oldest);
  }
  return absl::OkStatus();
}

void CoordinatorCore::EvictEndedJobs(absl::Time now) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const Job& job = *it->second;
    if (job.ended != absl::InfinitePast() && now - job.ended > options_.limits.job_retention) {
      Event("info", "job_evicted", job.id, -1, -1,
            absl::StrCat("no live rank for ", absl::ToInt64Milliseconds(now - job.ended),
                         " ms (job retention ", absl::ToInt64Milliseconds(options_.limits.job_retention), " ms)"));
      for (const Member& m : job.members) sessions_.erase(m.session);
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::Status CoordinatorCore::Register(uint64_t session_id, const v1::RegisterRequest& in,
                                       std::shared_ptr<RankSink> sink) {
  const v1::RegisterRequest req = WithRegisterDefaults(in, options_);
  // Stateless checks first: a malformed request changes nothing.
  if (absl::Status s = ValidateRegisterRequest(req, options_.limits, options_.max_lookahead); !s.ok()) return s;
  if (absl::Status s = CheckRootIsPossible(req); !s.ok()) return s;

  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("coordinator is shutting down");
  Job* job = ReuseOrForgetEndedJob(req);
  if (job == nullptr) {
    if (absl::Status s = AdmitJob(req.job_id(), req.world_size()); !s.ok()) return s;
  } else if (absl::Status s = CheckJobAccepts(*job, req); !s.ok()) {
    return s;
  }

  // Accepted: from here on state changes.
  if (job == nullptr) job = &CreateJob(req);
  Member& m = job->members[req.rank()];
  Group& group = job->groups[m.group];
  if (!group.has_reference) SetReference(group, req);
  const bool rejoin = m.state == v1::RANK_STATE_DEAD || m.state == v1::RANK_STATE_LEFT;
  SetLive(*job, m, session_id, std::move(sink), req);

  v1::CoordinatorMessage msg = Registered(group, req);
  const Policy policy = FromProto(req.policy());
  Event("info", rejoin ? "rank_rejoined" : "rank_registered", job->id, req.rank(), group.index,
        absl::StrCat("host=", req.host(), " pid=", req.pid(), " policy=", PolicyName(policy),
                     " fallback=", FallbackName(FromProto(req.fallback())), " modules=", req.modules_size(),
                     " lookahead=", req.lookahead()));
  if (policy == Policy::kPerLayer) {
    Event("warning", "per_layer_requested", job->id, req.rank(), group.index, msg.registered().warnings(0));
  }

  const int64_t epoch_before = group.epoch;
  UpdateGroupState(*job, group);
  msg.mutable_registered()->set_epoch(group.epoch);
  SendTo(m, msg);  // The RegisterResponse precedes anything else this rank is sent.
  OnMemberBack(*job, req.rank());
  if (group.epoch != epoch_before) AnnounceReformed(*job, group, req.rank());
  return absl::OkStatus();
}

CoordinatorCore::Job* CoordinatorCore::ReuseOrForgetEndedJob(const v1::RegisterRequest& req) {
  auto it = jobs_.find(req.job_id());
  if (it == jobs_.end()) return nullptr;
  Job* job = it->second.get();
  if (job->ended == absl::InfinitePast()) return job;
  // Every rank of the job left or died: this registration is a rerun or a restart from a
  // checkpoint. With another size the job starts afresh; with the same size it keeps its
  // history (communicator epochs, events, counts), and each group takes the manifest and
  // policy of its first rank to register again.
  if (job->world_size != req.world_size() || job->group_size != req.group_size()) {
    Event("info", "job_replaced", job->id, req.rank(), -1,
          absl::StrCat("no rank was live: the job starts afresh with world_size ", req.world_size(),
                       " and group_size ", req.group_size()));
    for (const Member& m : job->members) sessions_.erase(m.session);
    jobs_.erase(it);
    return nullptr;
  }
  for (Group& g : job->groups) g.has_reference = false;
  return job;
}

absl::Status CoordinatorCore::CheckJobAccepts(const Job& job, const v1::RegisterRequest& req) const {
  if (job.world_size != req.world_size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "register: world size mismatch: job '", job.id, "' has world_size ", job.world_size,
        " but rank ", req.rank(), " registered with ", req.world_size(),
        "; every rank of a job must pass the same world size"));
  }
  if (job.group_size != req.group_size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "register: group size mismatch: job '", job.id, "' has group_size ", job.group_size,
        " but rank ", req.rank(), " registered with ", req.group_size()));
  }
  const Member& existing = job.members[req.rank()];
  if (existing.state == v1::RANK_STATE_LIVE) {
    return absl::AlreadyExistsError(absl::StrCat(
        "register: duplicate rank ", req.rank(), " of job '", job.id,
        "': it is already live (host ", existing.host, ", pid ", existing.pid,
        "). If that process is gone, it is declared dead after the heartbeat timeout (",
        absl::ToInt64Milliseconds(options_.heartbeat_timeout),
        " ms); register again then"));
  }
  const Group& g = job.groups[existing.group];
  if (!g.has_reference) return absl::OkStatus();
  return CheckSameAsReference(g.reference, g.reference_rank, req,
                              absl::StrCat(" (job '", job.id, "', group ", g.index, ")"));
}

CoordinatorCore::Job& CoordinatorCore::CreateJob(const v1::RegisterRequest& req) {
  auto created = std::make_unique<Job>();
  created->id = req.job_id();
  created->world_size = req.world_size();
  created->group_size = req.group_size();
  created->members.resize(req.world_size());
  created->groups.resize(req.world_size() / req.group_size());
  for (int r = 0; r < req.world_size(); ++r) {
    created->members[r].rank = r;
    created->members[r].group = r / req.group_size();
    created->groups[r / req.group_size()].ranks.push_back(r);
  }
  for (size_t g = 0; g < created->groups.size(); ++g) created->groups[g].index = static_cast<int>(g);
  Job& job = *created;
  jobs_[req.job_id()] = std::move(created);
  Event("info", "job_created", job.id, -1, -1,
        absl::StrCat("world_size=", job.world_size, " group_size=", job.group_size, " groups=", job.groups.size()));
  return job;
}

void CoordinatorCore::SetLive(Job& job, Member& m, uint64_t session_id, std::shared_ptr<RankSink> sink,
                              const v1::RegisterRequest& req) {
  if (m.session != 0) sessions_.erase(m.session);
  m.state = v1::RANK_STATE_LIVE;
  m.session = session_id;
  m.sink = std::move(sink);
  m.host = req.host();
  m.pid = req.pid();
  m.last_seen = clock_->Now();
  m.last_planned.reset();
  m.pending = 0;
  m.dead_reason.clear();
  m.registrations++;
  m.lookahead = req.lookahead();
  m.memory_budget = req.memory_budget_bytes();
  m.outbox_overflow = false;
  job.ended = absl::InfinitePast();
  sessions_[session_id] = SessionRef{&job, req.rank()};
}

v1::CoordinatorMessage CoordinatorCore::Registered(const Group& group, const v1::RegisterRequest& req) const {
  v1::CoordinatorMessage msg;
  v1::RegisterResponse* resp = msg.mutable_registered();
  resp->set_group(group.index);
  for (int r : group.ranks) resp->add_group_ranks(r);
  resp->set_heartbeat_interval_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  resp->set_heartbeat_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_timeout)));
  resp->set_policy(req.policy());
  resp->set_fallback(req.fallback());
  resp->set_lookahead(req.lookahead());
  if (FromProto(req.policy()) == Policy::kPerLayer) {
    resp->add_warnings("policy per_layer: microbatches where ranks of the group diverge fall back to " +
                       std::string(FallbackName(FromProto(req.fallback()))) +
                       "; only uniform or all-skip microbatches shard per layer");
  }
  if (group.last_decided) ToProto(*group.last_decided, resp->mutable_last_decided());
  return msg;
}

void CoordinatorCore::AnnounceReformed(Job& job, const Group& group, int rank) {
  v1::CoordinatorMessage notice;
  notice.mutable_notice()->set_kind(v1::Notice::KIND_GROUP_REFORMED);
  notice.mutable_notice()->set_group(group.index);
  notice.mutable_notice()->set_epoch(group.epoch);
  notice.mutable_notice()->set_message(absl::StrCat("group ", group.index, " re-formed at epoch ", group.epoch,
                                                    " (rank ", rank, " registered again)"));
  for (int r : group.ranks) {
    if (r != rank) SendTo(job.members[r], notice);
  }
}

// The group state machine (DESIGN 8): FORMING -> HEALTHY -> FAILED -> FORMING (epoch + 1),
// FINISHED when every member left.
void CoordinatorCore::UpdateGroupState(Job& job, Group& group) {
  int live = 0, left = 0, dead = 0;
  for (int r : group.ranks) {
    switch (job.members[r].state) {
      case v1::RANK_STATE_LIVE: live++; break;
      case v1::RANK_STATE_LEFT: left++; break;
      case v1::RANK_STATE_DEAD: dead++; break;
      default: break;
    }
  }
  const int size = static_cast<int>(group.ranks.size());
  const v1::GroupState before = group.state;
  const bool reforming = before == v1::GROUP_STATE_FAILED || before == v1::GROUP_STATE_FINISHED;
  if (dead > 0) {
    group.state = v1::GROUP_STATE_FAILED;
  } else if (left == size) {
    group.state = v1::GROUP_STATE_FINISHED;
  } else if (reforming && live < size) {
    // After a failure (or after everyone left) the group re-forms only once every member
    // is live again: members that merely left would make it decide for ranks not there.
    group.state = v1::GROUP_STATE_FORMING;
    group.failure_reason.clear();
  } else if (live + left < size) {
    // Some member never registered (it may have died before it did).
    group.state = v1::GROUP_STATE_FORMING;
  } else if (before == v1::GROUP_STATE_FORMING && group.engine->next_seq() == 0 && group.epoch == 0) {
    // Formed for the first time: the promotion budget is known now.
    group.state = v1::GROUP_STATE_HEALTHY;
    const int64_t min_budget = SetPromotionBudget(job, group);
    Event("info", "group_formed", job.id, -1, group.index,
          absl::StrCat("ranks ", RankList(group.ranks), " policy=",
                       PolicyName(group.engine->config().policy),
                       " fallback=", FallbackName(group.engine->config().fallback),
                       " min_memory_budget_bytes=", min_budget));
  } else if (before != v1::GROUP_STATE_HEALTHY) {
    // Whole again after a failure: a new epoch. Microbatch keys start afresh (a job
    // resumed from a checkpoint plans earlier steps again); seq numbers go on.
    group.epoch++;
    group.failure_reason.clear();
    group.pending.clear();
    group.last_resolved.reset();
    for (int r : group.ranks) {
      job.members[r].pending = 0;
      job.members[r].last_planned.reset();
    }
    group.static_seq = 0;  // Static seqs restart with the keys.
    if (group.engine->config().min_memory_budget_bytes == 0 && group.engine->next_seq() == 0) {
      SetPromotionBudget(job, group);  // Whole for the first time through a failure.
    }
    group.state = v1::GROUP_STATE_HEALTHY;
    Event("info", "group_reformed", job.id, -1, group.index,
          absl::StrCat("epoch ", group.epoch, " ranks ", RankList(group.ranks)));
  }
}

int64_t CoordinatorCore::SetPromotionBudget(Job& job, Group& group) {
  int64_t min_budget = INT64_MAX;
  for (int r : group.ranks) min_budget = std::min(min_budget, job.members[r].memory_budget);
  EngineConfig cfg = group.engine->config();
  cfg.min_memory_budget_bytes = min_budget;
  group.engine = std::make_unique<DecisionEngine>(std::move(cfg));
  return min_budget;
}

// ----------------------------------------------------------------------------------------
// Plans

CoordinatorCore::Member* CoordinatorCore::LiveMember(uint64_t session_id, Job** job) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return nullptr;
  Member& m = it->second.job->members[it->second.rank];
  if (m.session != session_id || m.state != v1::RANK_STATE_LIVE) return nullptr;
  *job = it->second.job;
  return &m;
}

bool CoordinatorCore::WillNeverReport(const Member& m, const MicrobatchKey& key) const {
  if (m.state == v1::RANK_STATE_LEFT) return !m.last_planned || *m.last_planned < key;
  return m.last_planned && key < *m.last_planned;
}

void CoordinatorCore::OnPlans(uint64_t session_id, const v1::PlanBatch& batch) {
  absl::MutexLock lock(&mu_);
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;  // A stale session; its rank re-registered or was declared dead.
  m->last_seen = clock_->Now();
  Group& group = job->groups[m->group];
  for (const auto& plan : batch.plans()) {
    absl::Status s = batch.epoch() == group.epoch
                         ? AcceptPlan(*job, *m, plan)
                         : absl::AbortedError(absl::StrCat(
                               "plan ", MicrobatchKey{plan.step(), plan.microbatch()}.ToString(), " from rank ", m->rank,
                               " was made in epoch ", batch.epoch(), " but group ", group.index, " is at epoch ",
                               group.epoch, ": it was queued before the group failed; plan again"));
    if (!s.ok()) {
      m->plans_rejected++;
      v1::CoordinatorMessage msg;
      auto* rej = msg.mutable_plan_rejected();
      rej->set_step(plan.step());
      rej->set_microbatch(plan.microbatch());
      rej->set_code(static_cast<int>(s.code()));
      rej->set_message(std::string(s.message()));
      rej->set_epoch(batch.epoch());
      static const auto log = logging::Get("coordinator");
      static logging::RateLimit limit(10);  // A client sending 10^5 bad plans gets 10 lines a second.
      int64_t suppressed = 0;
      if (limit.Allow(&suppressed)) {
        log->warn("plan_rejected job={} rank={} step={} mb={} code={} {}{}", job->id, m->rank, plan.step(),
                  plan.microbatch(), absl::StatusCodeToString(s.code()), std::string(s.message()),
                  suppressed > 0 ? absl::StrCat(" (", suppressed, " more plan rejections not logged)") : "");
      }
      SendTo(*m, msg);
    }
  }
  Flush(*job, group);
}

absl::Status CoordinatorCore::AcceptPlan(Job& job, Member& m, const v1::MicrobatchPlan& plan) {
  Group& group = job.groups[m.group];
  const MicrobatchKey key{plan.step(), plan.microbatch()};
  const std::string who = absl::StrCat("rank ", m.rank, " (job '", job.id, "', group ", group.index, ")");
  if (plan.step() < 0 || plan.microbatch() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("plan ", key.ToString(), " from ", who,
                                                   ": step and microbatch must be >= 0"));
  }
  std::vector<std::pair<int, int32_t>> calls;  // (module index, calls)
  calls.reserve(plan.calls_size());
  for (const auto& [name, count] : plan.calls()) {
    auto mi = group.module_index.find(name);
    if (mi == group.module_index.end()) {
      std::vector<std::string> known;
      for (const auto& spec : group.modules) known.push_back(spec.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "plan ", key.ToString(), " from ", who, " names unknown module '", name,
          "'; the registered controlled modules are [", NameList(known), "]"));
    }
    if (count < 0) {
      return absl::InvalidArgumentError(absl::StrCat("plan ", key.ToString(), " from ", who,
                                                     ": module '", name, "' has ", count,
                                                     " calls; calls must be >= 0"));
    }
    calls.emplace_back(mi->second, count);
  }
  if (m.last_planned && key <= *m.last_planned) {
    return absl::FailedPreconditionError(absl::StrCat(
        "out-of-order plan ", key.ToString(), " from ", who, ": its previous plan was ",
        m.last_planned->ToString(), "; plans must be reported in increasing (step, microbatch) order"));
  }
  if (group.state == v1::GROUP_STATE_FAILED) {
    return absl::AbortedError(absl::StrCat("plan ", key.ToString(), " from ", who,
                                           " dropped: the group failed at epoch ", group.epoch,
                                           " (", group.failure_reason,
                                           "); wait for the group to re-form"));
  }

  const int idx = static_cast<int>(std::lower_bound(group.ranks.begin(), group.ranks.end(), m.rank) -
                                   group.ranks.begin());
  if (group.engine->is_static()) return AcceptStaticPlan(job, group, m, key, idx);

  if (group.last_resolved && key <= *group.last_resolved && !group.pending.count(key)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "plan ", key.ToString(), " from ", who, " is stale: group ", group.index,
        " already resolved every microbatch up to ", group.last_resolved->ToString()));
  }
  if (m.pending >= m.lookahead) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "plan ", key.ToString(), " from ", who, " is beyond the lookahead window: ", m.pending,
        " plans are undecided and the window is ", m.lookahead,
        "; wait for the oldest decision before planning further ahead"));
  }

  if (!group.pending.count(key)) {
    if (absl::Status s = CheckPendingRoom(group, key, who); !s.ok()) return s;
  }

  // Accepted.
  m.last_planned = key;
  m.plans_received++;
  job.plans_received++;
  const int size = static_cast<int>(group.ranks.size());
  auto [it, inserted] = group.pending.try_emplace(key);
  PendingMicrobatch& p = it->second;
  if (inserted) {
    p.calls.assign(group.modules.size(), std::vector<int32_t>(size, 0));
    p.reported.assign(size, false);
    p.first_report = clock_->Now();
  }
  for (const auto& [mi, count] : calls) p.calls[mi][idx] = count;
  if (!p.reported[idx]) {  // A rank that left and came back may report a pending key again.
    p.reported[idx] = true;
    p.num_reported++;
    m.pending++;
  }

  if (!FailSkipped(job, group, m, key, idx, inserted)) return absl::OkStatus();
  DrainGroup(job, group);
  return absl::OkStatus();
}

absl::Status CoordinatorCore::CheckPendingRoom(const Group& group, const MicrobatchKey& key,
                                              const std::string& who) const {
  if (static_cast<int>(group.pending.size()) < options_.limits.max_pending_microbatches) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "plan ", key.ToString(), " from ", who, ": group ", group.index, " already holds ", group.pending.size(),
      " microbatches that some ranks reported and others not yet (max_pending_microbatches); the ranks of "
      "the group are too far apart: wait for the slowest, or raise --max-pending-microbatches"));
}

bool CoordinatorCore::FailSkipped(Job& job, Group& group, Member& m, const MicrobatchKey& key, int idx,
                                  bool inserted) {
  // Microbatches this rank skipped: earlier pending ones it never reported.
  std::vector<MicrobatchKey> skipped;
  for (auto& [k, pk] : group.pending) {
    if (!(k < key)) break;
    if (!pk.reported[idx]) skipped.push_back(k);
  }
  for (const auto& k : skipped) {
    FailMicrobatch(job, group, k, absl::FailedPreconditionError(absl::StrCat(
        "microbatch ", k.ToString(), " of group ", group.index, " can never be decided: rank ",
        m.rank, " reported ", key.ToString(), " without reporting ", k.ToString(),
        "; every rank of a shard group must run the same microbatches")));
  }
  if (!inserted) return true;
  // Ranks that already moved past this key (or left) will never report it.
  const PendingMicrobatch& p = group.pending.at(key);
  std::vector<int> never;
  for (size_t i = 0; i < group.ranks.size(); ++i) {
    if (!p.reported[i] && WillNeverReport(job.members[group.ranks[i]], key)) never.push_back(group.ranks[i]);
  }
  if (never.empty()) return true;
  FailMicrobatch(job, group, key, absl::FailedPreconditionError(absl::StrCat(
      "microbatch ", key.ToString(), " of group ", group.index, " can never be decided: ranks ", RankList(never),
      " already planned later microbatches or left; every rank of a shard group must run the same microbatches")));
  return false;
}

absl::Status CoordinatorCore::AcceptStaticPlan(Job& job, Group& group, Member& m, const MicrobatchKey& key,
                                               int idx) {
  // root / replicate: the rank gets its decision at once, without waiting for the group.
  // The decision (and its seq) is made once per key, when the first rank reports it, so every
  // rank of the group receives the identical decision; the key stays pending until every rank
  // reported it, which is how a rank that skips a microbatch is caught (the microbatch fails
  // for the whole group, as under auto).
  const std::string who = absl::StrCat("rank ", m.rank, " (job '", job.id, "', group ", group.index, ")");
  auto it = group.pending.find(key);
  if (it == group.pending.end()) {
    if (group.last_resolved && key <= *group.last_resolved) {
      return absl::FailedPreconditionError(absl::StrCat(
          "plan ", key.ToString(), " from ", who, " is stale: group ", group.index,
          " already resolved every microbatch up to ", group.last_resolved->ToString()));
    }
    if (absl::Status s = CheckPendingRoom(group, key, who); !s.ok()) return s;
  }
  m.last_planned = key;
  m.plans_received++;
  job.plans_received++;
  const int size = static_cast<int>(group.ranks.size());
  const bool inserted = it == group.pending.end();
  if (inserted) {
    it = group.pending.try_emplace(key).first;
    PendingMicrobatch& p = it->second;
    p.reported.assign(size, false);
    p.first_report = clock_->Now();
    v1::MicrobatchDecision pd;
    ToProto(group.engine->DecideStatic(key, group.epoch, group.static_seq++), &pd);
    pd.set_decided_unix_ms(absl::ToUnixMillis(clock_->Now()));
    RecordDecision(job, group, pd);
    p.decided = std::move(pd);
  }
  PendingMicrobatch& p = it->second;
  if (!p.reported[idx]) {
    p.reported[idx] = true;
    p.num_reported++;
    m.pending++;
  }
  QueueDecision(m, *p.decided);
  if (!FailSkipped(job, group, m, key, idx, inserted)) return absl::OkStatus();
  // Resolved once every rank reported it; entries before it were failed above.
  if (p.num_reported == size) {
    for (int r : group.ranks) {
      if (job.members[r].pending > 0) job.members[r].pending--;
    }
    if (!group.last_resolved || *group.last_resolved < key) group.last_resolved = key;
    group.pending.erase(it);
  }
  return absl::OkStatus();
}

void CoordinatorCore::DrainGroup(Job& job, Group& group) {
  const int size = static_cast<int>(group.ranks.size());
  if (group.state != v1::GROUP_STATE_HEALTHY) return;  // Forming: not everyone can plan yet.
  if (group.engine->is_static()) return;              // Decided as reported (AcceptStaticPlan).
  while (!group.pending.empty()) {
    auto it = group.pending.begin();
    if (it->second.num_reported < size) break;
    std::vector<EngineTransition> transitions;
    MicrobatchDecision d = group.engine->Decide(it->first, group.epoch, it->second.calls, &transitions);
    v1::MicrobatchDecision pd;
    ToProto(d, &pd);
    pd.set_decided_unix_ms(absl::ToUnixMillis(clock_->Now()));
    for (int r : group.ranks) {
      Member& mem = job.members[r];
      if (mem.pending > 0) mem.pending--;
      QueueDecision(mem, pd);
    }
    group.last_resolved = it->first;
    group.last_decided = it->first;
    RecordDecision(job, group, pd);
    group.pending.erase(it);
    for (const auto& t : transitions) {
      Event("info", "module_" + t.what, job.id, -1, group.index,
            absl::StrCat("module '", t.module, "': ", t.detail));
    }
  }
}

void CoordinatorCore::RecordDecision(Job& job, Group& group, const v1::MicrobatchDecision& d) {
  job.microbatches_decided++;
  for (const auto& md : d.modules()) {
    switch (md.decision()) {
      case v1::DECISION_PER_LAYER: group.counts.set_per_layer(group.counts.per_layer() + 1); break;
      case v1::DECISION_SKIP: group.counts.set_skip(group.counts.skip() + 1); break;
      case v1::DECISION_ROOT: group.counts.set_root(group.counts.root() + 1); break;
      case v1::DECISION_REPLICATE: group.counts.set_replicate(group.counts.replicate() + 1); break;
      default: break;
    }
    if (md.reason() == v1::REASON_DIVERGENT) group.counts.set_divergent(group.counts.divergent() + 1);
  }
  group.last_decided = MicrobatchKey{d.step(), d.microbatch()};
  group.history.push_back(d);
  while (static_cast<int>(group.history.size()) > options_.decision_history) group.history.pop_front();
}

void CoordinatorCore::QueueDecision(Member& m, const v1::MicrobatchDecision& d) {
  if (m.state != v1::RANK_STATE_LIVE || !m.sink) return;
  *m.outgoing.mutable_decisions()->add_decisions() = d;
}

void CoordinatorCore::Flush(Job& job, const Group& group) {
  for (int r : group.ranks) {
    Member& m = job.members[r];
    if (m.outgoing.has_decisions() && m.outgoing.decisions().decisions_size() > 0) {
      SinkSend(m, m.outgoing);
      m.outgoing.Clear();
    }
  }
}

void CoordinatorCore::SendTo(Member& m, const v1::CoordinatorMessage& msg) {
  if (m.state != v1::RANK_STATE_LIVE || !m.sink) return;
  // Decisions batched so far go first: the rank sees messages in the order produced.
  if (m.outgoing.has_decisions() && m.outgoing.decisions().decisions_size() > 0) {
    SinkSend(m, m.outgoing);
    m.outgoing.Clear();
  }
  SinkSend(m, msg);
}

void CoordinatorCore::SinkSend(Member& m, const v1::CoordinatorMessage& msg) {
  if (!m.sink || m.outbox_overflow) return;
  // Refused: the rank is not reading. Tick fails it (not here: we may be deep inside a
  // group's state change); until then nothing more is queued for it.
  if (!m.sink->Send(msg)) m.outbox_overflow = true;
}

void CoordinatorCore::FailMicrobatch(Job& job, Group& group, const MicrobatchKey& key,
                                     absl::Status why) {
  auto it = group.pending.find(key);
  if (it == group.pending.end()) return;
  v1::CoordinatorMessage msg;
  auto* f = msg.mutable_microbatch_failed();
  f->set_group(group.index);
  f->set_step(key.step);
  f->set_microbatch(key.microbatch);
  f->set_code(static_cast<int>(why.code()));
  f->set_message(std::string(why.message()));
  for (size_t i = 0; i < group.ranks.size(); ++i) {
    Member& mem = job.members[group.ranks[i]];
    if (it->second.reported[i] && mem.pending > 0) mem.pending--;
    SendTo(mem, msg);
  }
  group.pending.erase(it);
  if (!group.last_resolved || *group.last_resolved < key) group.last_resolved = key;
  Event("error", "microbatch_failed", job.id, -1, group.index, std::string(why.message()));
}

// ----------------------------------------------------------------------------------------
// Liveness

void CoordinatorCore::OnHeartbeat(uint64_t session_id, const v1::Heartbeat& heartbeat) {
  absl::MutexLock lock(&mu_);
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;
  m->last_seen = clock_->Now();
  if (heartbeat.comms_size() > 0) RecordProgress(*job, m->rank, heartbeat, m->last_seen);
  if (heartbeat.memory_size() > 0) m->memory.assign(heartbeat.memory().begin(), heartbeat.memory().end());
}

void CoordinatorCore::OnGoodbye(uint64_t session_id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;
  RemoveMember(*job, *m, /*clean=*/true,
               reason.empty() ? std::string("left cleanly") : absl::StrCat("left cleanly: ", reason));
}

void CoordinatorCore::OnSessionClosed(uint64_t session_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;  // Our own shutdown closed it: no rank died.
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) {
    sessions_.erase(session_id);
    return;
  }
  RemoveMember(*job, *m, /*clean=*/false, absl::StrCat("session stream lost (", why, ")"));
}

void CoordinatorCore::RemoveMember(Job& job, Member& m, bool clean, const std::string& reason) {
  Group& group = job.groups[m.group];
  const std::string full = absl::StrCat("rank ", m.rank, " ", clean ? "" : "declared dead: ", reason);
  // Flush what it was owed, then detach it.
  if (m.sink) {
    if (m.outgoing.has_decisions()) {
      SinkSend(m, m.outgoing);
      m.outgoing.Clear();
    }
    m.sink->Close(clean ? absl::OkStatus() : absl::AbortedError(full));
  }
  m.sink.reset();
  sessions_.erase(m.session);
  m.state = clean ? v1::RANK_STATE_LEFT : v1::RANK_STATE_DEAD;
  m.dead_reason = reason;
  Event(clean ? "info" : "error", clean ? "rank_left" : "rank_dead", job.id, m.rank, group.index, full);
  if (std::none_of(job.members.begin(), job.members.end(),
                   [](const Member& x) { return x.state == v1::RANK_STATE_LIVE; })) {
    job.ended = clock_->Now();  // Kept for `job_retention`, then forgotten.
    // An ended job is kept to be looked at, not to decide: its groups keep their last few
    // decisions only (up to max_jobs ended jobs may wait for eviction at once).
    for (Group& g : job.groups) {
      while (g.history.size() > kEndedJobHistory) g.history.pop_front();
      g.history.shrink_to_fit();
    }
  }
  OnMemberLost(job, m.rank, clean, full);

  if (clean) {
    // Pending microbatches it never reported can never be decided.
    const int idx = static_cast<int>(
        std::lower_bound(group.ranks.begin(), group.ranks.end(), m.rank) - group.ranks.begin());
    std::vector<MicrobatchKey> doomed;
    for (const auto& [k, p] : group.pending) {
      if (!p.reported[idx]) doomed.push_back(k);
    }
    for (const auto& k : doomed) {
      FailMicrobatch(job, group, k, absl::FailedPreconditionError(absl::StrCat(
          "microbatch ", k.ToString(), " of group ", group.index, " can never be decided: rank ",
          m.rank, " left the job without planning it")));
    }
    UpdateGroupState(job, group);
    DrainGroup(job, group);
    Flush(job, group);
    return;
  }

  // A death fails the group: cancel everything pending and tell every live member.
  const bool was_failed = group.state == v1::GROUP_STATE_FAILED;
  v1::CoordinatorMessage msg;
  auto* gf = msg.mutable_group_failure();
  gf->set_group(group.index);
  gf->set_epoch(group.epoch);
  for (int r : group.ranks) {
    if (job.members[r].state == v1::RANK_STATE_DEAD) gf->add_dead_ranks(r);
  }
  for (const auto& [k, p] : group.pending) ToProto(k, gf->add_cancelled());
  group.pending.clear();
  for (int r : group.ranks) job.members[r].pending = 0;
  group.failure_reason = was_failed ? absl::StrCat(group.failure_reason, "; ", full) : full;
  gf->set_reason(absl::StrCat("group ", group.index, " of job '", job.id, "' failed at epoch ",
                              group.epoch, ": ", group.failure_reason));
  UpdateGroupState(job, group);
  for (int r : group.ranks) SendTo(job.members[r], msg);
  Event("error", "group_failed", job.id, m.rank, group.index,
        absl::StrCat(gf->reason(), "; cancelled ", gf->cancelled_size(), " pending microbatches"));
  NotifyRankLost(job, group, m.rank, gf->reason());
}

void CoordinatorCore::NotifyRankLost(Job& job, const Group& group, int rank, const std::string& reason) {
  // The rest of the job (DESIGN 3): collectives that span groups include the dead rank too.
  if (job.groups.size() < 2) return;
  v1::CoordinatorMessage msg;
  auto* n = msg.mutable_notice();
  n->set_kind(v1::Notice::KIND_RANK_LOST);
  n->set_group(group.index);
  n->set_epoch(group.epoch);
  n->set_rank(rank);
  n->set_message(reason);
  for (Member& other : job.members) {
    if (other.group != group.index && other.state == v1::RANK_STATE_LIVE) SendTo(other, msg);
  }
}

void CoordinatorCore::Tick() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  EvictEndedJobs(now);
  for (auto& [id, job] : jobs_) {
    for (Member& m : job->members) {
      if (m.state != v1::RANK_STATE_LIVE) continue;
      if (m.outbox_overflow) {
        RemoveMember(*job, m, /*clean=*/false,
                     absl::StrCat("not reading its session stream: more than ", options_.limits.max_outbox_bytes,
                                  " bytes were queued for it (max_outbox_bytes); a rank must keep reading "
                                  "its decisions"));
        continue;
      }
      absl::Duration silent = now - m.last_seen;
      if (silent > options_.heartbeat_timeout) {
        RemoveMember(*job, m, /*clean=*/false,
                     absl::StrCat("no heartbeat for ", absl::ToInt64Milliseconds(silent),
                                  " ms (heartbeat timeout ",
                                  absl::ToInt64Milliseconds(options_.heartbeat_timeout), " ms)"));
      }
    }
    for (Group& group : job->groups) {
      std::vector<std::pair<MicrobatchKey, absl::Status>> expired;
      for (const auto& [k, p] : group.pending) {
        absl::Duration waited = now - p.first_report;
        if (waited <= options_.plan_timeout) continue;
        std::vector<int> missing, have;
        for (size_t i = 0; i < group.ranks.size(); ++i) {
          (p.reported[i] ? have : missing).push_back(group.ranks[i]);
        }
        expired.emplace_back(k, absl::DeadlineExceededError(absl::StrCat(
            "group ", group.index, " waited ", absl::ToInt64Milliseconds(waited),
            " ms for the plan of ", k.ToString(), " from ranks ", RankList(missing), " (ranks ",
            RankList(have), " reported it); plan timeout is ",
            absl::ToInt64Milliseconds(options_.plan_timeout),
            " ms: raise --plan-timeout-ms if ranks legitimately fall this far behind")));
      }
      for (auto& [k, s] : expired) FailMicrobatch(*job, group, k, s);
      if (!expired.empty()) Flush(*job, group);
    }
    ExpireCommWaiters(*job, now);
    DetectBehind(*job, now);
  }
}

void CoordinatorCore::OnPaused(absl::Duration gap) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  int extended = 0;
  for (auto& [id, job] : jobs_) {
    for (Member& m : job->members) {
      if (m.state != v1::RANK_STATE_LIVE) continue;
      m.last_seen = std::max(m.last_seen, now);
      extended++;
    }
  }
  const std::string what = absl::StrCat("the coordinator did not run for ", absl::ToInt64Milliseconds(gap),
                                        " ms (paused, starved or the clock jumped); heartbeat deadlines of ",
                                        extended, " live ranks restarted instead of declaring them dead");
  logging::Get("coordinator")->warn("{}", what);
  Event("warning", "coordinator_paused", "", -1, -1, what);
}

void CoordinatorCore::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  FailAllCommWaiters(absl::UnavailableError("coordinator is shutting down"));
  v1::CoordinatorMessage notice;
  notice.mutable_notice()->set_kind(v1::Notice::KIND_SHUTDOWN);
  notice.mutable_notice()->set_message("coordinator is shutting down");
  for (auto& [id, job] : jobs_) {
    for (Member& m : job->members) {
      if (m.state != v1::RANK_STATE_LIVE || !m.sink) continue;
      SendTo(m, notice);
      m.sink->Close(absl::UnavailableError("coordinator is shutting down"));
      m.sink.reset();
    }
  }
}

}  // namespace shardcoord::coordinator
