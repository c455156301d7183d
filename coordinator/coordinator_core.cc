// CoordinatorCore, part 1: registration and the group state machine (DESIGN 3, 8). The other
// parts: _plans.cc (plans and decisions), _liveness.cc (deaths, leaves, the tick), _comms.cc
// (communicators), _status.cc (the views operators query).
#include "coordinator/coordinator_core.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"
#include "coordinator/daemon_metrics.h"
#include "coordinator/registration.h"
#include "coordinator/secrets.h"
#include "coordinator/text.h"

namespace shardcoord::coordinator {
namespace {


}  // namespace

CoordinatorCore::CoordinatorCore(CoordinatorOptions options, std::shared_ptr<const Clock> clock)
    : options_(std::move(options)),
      clock_(std::move(clock)),
      started_(clock_->Now()),
      incarnation_(options_.incarnation != 0 ? options_.incarnation : 1),
      config_digest_(DecisionConfigDigest(options_)),
      resume_auth_(options_.resume_key.empty() ? ResumeAuthority::Ephemeral()
                                               : ResumeAuthority(options_.resume_key, /*persistent=*/true)),
      journal_(options_.event_capacity),
      metrics_(std::make_unique<DaemonMetrics>()),
      buffers_(std::make_shared<BufferBudget>(options_.limits.max_buffered_bytes)) {}

CoordinatorCore::~CoordinatorCore() = default;

void CoordinatorCore::Event(const std::string& severity, EventKind kind,
                            const std::string& job, int rank, int group,
                            const std::string& message) {
  journal_.Add(clock_->Now(), severity, EventKindName(kind), job, rank, group, message);
  metrics_->CountEvent(kind);
  const auto level = severity == "error"     ? spdlog::level::err
                     : severity == "warning" ? spdlog::level::warn
                                             : spdlog::level::info;
  // Only what the event concerns: a daemon event has no job, a job's none of rank or group.
  std::string line = absl::StrCat("event=", EventKindName(kind));
  if (!job.empty()) absl::StrAppend(&line, " job=", job);
  if (rank >= 0) absl::StrAppend(&line, " rank=", rank);
  if (group >= 0) absl::StrAppend(&line, " group=", group);
  absl::StrAppend(&line, " ", message);
  Defer([level, line = std::move(line)] {
    static const auto log = logging::Get("coordinator");
    log->log(level, "{}", line);
  });
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
    group.module_counts[m.name()];  // Every module's counts exist, at zero, from the start.
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
    Event("info", EventKind::kJobEvicted, oldest->first, -1, -1, "evicted to admit a new job (max_jobs or max_total_ranks reached)");
    for (const Member& m : oldest->second->members) sessions_.erase(m.session);
    jobs_.erase(oldest);
  }
  return absl::OkStatus();
}

void CoordinatorCore::EvictEndedJobs(absl::Time now) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const Job& job = *it->second;
    if (job.ended != absl::InfinitePast() && now - job.ended > options_.limits.job_retention) {
      Event("info", EventKind::kJobEvicted, job.id, -1, -1,
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
  // A rank of an earlier coordinator process resumes (DESIGN 12); one of this process that
  // lost its stream registers again as usual.
  const bool resuming = req.has_resume() && req.resume().incarnation() != incarnation_;
  bool verified = true;
  if (resuming) {
    if (absl::Status s = CheckResume(req, incarnation_, config_digest_); !s.ok()) return s;
    if (absl::Status s = CheckResumeTrust(req, resume_auth_, &verified); !s.ok()) return s;
  }

  Locked lock(this);
  if (shut_down_) return absl::UnavailableError("coordinator is shutting down");
  if (resuming && !verified && clock_->Now() - started_ > options_.recovery_window) {
    // Honest resumes come within seconds of a restart (a worker reconnects for its reconnect
    // window); an unverifiable one long after is no restart's.
    return absl::PermissionDeniedError(absl::StrCat(
        "register: rank ", req.rank(), " of job '", req.job_id(), "' resumes from an earlier coordinator ",
        absl::ToInt64Seconds(clock_->Now() - started_), " s after this one started: without a resume key (--state-file "
        "or --token-file) a resume is taken unverified only within the recovery window (",
        absl::ToInt64Milliseconds(options_.recovery_window), " ms) after a start; register afresh"));
  }
  Job* job = ReuseOrForgetEndedJob(req);
  if (job == nullptr) {
    if (absl::Status s = AdmitJob(req.job_id(), req.world_size()); !s.ok()) return s;
  } else if (absl::Status s = CheckJobAccepts(*job, req); !s.ok()) {
    return s;
  }

  BufferCharge resume_charge;
  if (resuming) {
    absl::StatusOr<BufferCharge> charge = ChargeResume(req);
    if (!charge.ok()) return charge.status();
    resume_charge = std::move(*charge);
  }

  // Accepted: from here on state changes.
  if (job == nullptr) job = &CreateJob(req);
  Member& m = job->members[req.rank()];
  Group& group = job->groups[m.group];
  if (!group.has_reference) SetReference(group, req);
  // The first rank of a group this process has not seen at work resumes: the group waits
  // for all its members (another group's fresh rank may have created the job first).
  if (resuming && IsFreshGroup(*job, group)) StartRecovery(*job, group);
  if (resuming && !verified) {
    Event("warning", EventKind::kResumeUnverified, job->id, req.rank(), group.index,
          "taken as sent: this coordinator has no resume key that outlived the last one (start it with --state-file "
          "or --token-file so that resumes are checked)");
  }
  if (group.state == v1::GROUP_STATE_RECOVERING) {
    ResumeMember(*job, group, m, session_id, std::move(sink), req, std::move(resume_charge));
    return absl::OkStatus();
  }
  const bool rejoin = m.state == v1::RANK_STATE_DEAD || m.state == v1::RANK_STATE_LEFT;
  SetLive(*job, m, session_id, std::move(sink), req);

  v1::CoordinatorMessage msg = Registered(group, req);
  msg.mutable_registered()->set_session_key(m.session_key);
  msg.mutable_registered()->set_resume_credential(resume_auth_.Credential(job->id, req.rank()));
  const Policy policy = FromProto(req.policy());
  Event("info", rejoin ? EventKind::kRankRejoined : EventKind::kRankRegistered, job->id, req.rank(), group.index,
        absl::StrCat("host=", req.host(), " policy=", PolicyName(policy),
                     " fallback=", FallbackName(FromProto(req.fallback())), " modules=", req.modules_size(),
                     " lookahead=", req.lookahead()));
  if (policy == Policy::kPerLayer) {
    Event("warning", EventKind::kPerLayerRequested, job->id, req.rank(), group.index, msg.registered().warnings(0));
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
    Event("info", EventKind::kJobReplaced, job->id, req.rank(), -1,
          absl::StrCat("no rank was live: the job starts afresh with world_size ", req.world_size(),
                       " and group_size ", req.group_size()));
    for (const Member& m : job->members) sessions_.erase(m.session);
    jobs_.erase(it);
    return nullptr;
  }
  // A rerun plans its keys from the start again: each group begins a new epoch with no
  // microbatch resolved (else every plan of the rerun is "stale" until job_retention_ms
  // forgets the job).
  for (Group& g : job->groups) {
    g.has_reference = false;
    g.pending.clear();
    g.deferred_plans.clear();
    g.last_resolved.reset();
    g.last_decided.reset();  // The group re-forms in a new epoch once its members are back.
    g.static_seq = 0;
    for (int r : g.ranks) {
      job->members[r].pending = 0;
      job->members[r].last_planned.reset();
    }
  }
  Event("info", EventKind::kJobRerun, job->id, req.rank(), -1,
        "every rank had left: the job runs again under the same id and sizes, its keys from the start");
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
        "': it is already live (host ", existing.host,
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
  const bool no_modules = req.modules_size() == 0;
  Event(no_modules ? "warning" : "info", EventKind::kJobCreated, job.id, -1, -1,
        absl::StrCat("world_size=", job.world_size, " group_size=", job.group_size, " groups=", job.groups.size(),
                     " modules=", req.modules_size(),
                     no_modules ? " (no controlled module: nothing is coordinated; the ranks' manifest is empty)" : ""));
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
  m.resume.reset();  // A resume is held only from ResumeMember on (which sets it after this).
  m.resume_charge = BufferCharge();
  m.registrations++;
  m.lookahead = req.lookahead();
  m.memory_budget = req.memory_budget_bytes();
  m.cut_reason.clear();
  m.session_key = NewSessionKey();
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
  resp->set_accepts_bundles(true);
  resp->set_coordinator_version(shardcoord::kVersion);
  if (FromProto(req.policy()) == Policy::kPerLayer) {
    resp->add_warnings("policy per_layer: microbatches where ranks of the group diverge fall back to " +
                       std::string(FallbackName(FromProto(req.fallback()))) +
                       "; only uniform or all-skip microbatches shard per layer");
  }
  if (group.last_decided) ToProto(*group.last_decided, resp->mutable_last_decided());
  resp->set_incarnation(incarnation_);
  resp->set_config_digest(config_digest_);
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
  // Recovering after a restart: FinishRecovery or ExpireRecovery ends it, or a death.
  if (before == v1::GROUP_STATE_RECOVERING && dead == 0) return;
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
    Event("info", EventKind::kGroupFormed, job.id, -1, group.index,
          absl::StrCat("ranks ", RankList(group.ranks), " policy=",
                       PolicyName(group.engine->config().policy),
                       " fallback=", FallbackName(group.engine->config().fallback),
                       " min_memory_budget_bytes=", min_budget));
  } else if (before != v1::GROUP_STATE_HEALTHY) {
    // Whole again after a failure: a new epoch. Microbatch keys start afresh (a job
    // resumed from a checkpoint plans earlier steps again). The engine's seq (auto,
    // per_layer) goes on; the static policies' seq restarts at 0 with the epoch.
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
    Event("info", EventKind::kGroupReformed, job.id, -1, group.index,
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

}  // namespace shardcoord::coordinator
