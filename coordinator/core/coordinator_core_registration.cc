// CoordinatorCore: registration (DESIGN 3, "Registration"): a rank joins its job (created on
// the first registration, or run again under the same id once every rank had left) and its
// shard group, or resumes after a coordinator restart (coordinator_core_recovery.cc).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/registration.h"
#include "coordinator/engine/text.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {

absl::Status CoordinatorCore::Register(uint64_t session_id, const Registration& in,
                                       std::shared_ptr<RankSink> sink) {
  const Registration req = WithRegisterDefaults(in, options_);
  if (absl::Status s = CheckRequestAlone(req); !s.ok()) return s;
  // A rank of an earlier coordinator process resumes (DESIGN 12); one of this process that
  // lost its stream registers again as usual.
  const bool resuming = req.resume.has_value() && req.resume->incarnation() != incarnation_;
  bool verified = true;
  absl::Status trust = absl::OkStatus();
  if (resuming) {
    if (absl::Status s = CheckResume(req, incarnation_, config_digest_); !s.ok()) return s;
    trust = CheckResumeTrust(req, resume_auth_, &verified);
  }

  CoreLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("coordinator is shutting down");
  if (resuming) {
    absl::Status s = trust.ok() ? (verified ? CheckResumedRun(req) : CheckUnverifiedResumeIsTimely(req)) : trust;
    if (!s.ok()) return RefuseResume(req, s);
  }
  const Job* before = jobs_.Find(req.job_id);
  const std::string run_before = before != nullptr ? before->run : "";
  const bool proves = resuming && verified;  // Only a persistent key verifies a resume.
  const RegistrationClaim proven{proves ? req.resume->incarnation() : 0, proves ? req.resume->previous().registration() : 0};
  absl::StatusOr<Job*> found = FindOrAdmitJob(req, proves ? &proven : nullptr);
  if (!found.ok()) {
    const bool trust = found.status().code() == absl::StatusCode::kPermissionDenied;
    return resuming && trust ? RefuseResume(req, found.status()) : found.status();
  }
  Job* job = *found;
  BufferCharge resume_charge;
  if (resuming) {
    absl::StatusOr<BufferCharge> charge = ChargeResume(req);
    if (!charge.ok()) return charge.status();
    resume_charge = std::move(*charge);
  }

  // Accepted: from here on state changes.
  if (job == nullptr) job = &CreateJob(req, RunOfNewJob(req, resuming));
  if (job->run != run_before) SyncRunPins(job);  // A new run (a new job, a rerun): pinned before any answer.
  Seat(*job, req, session_id, std::move(sink), std::move(resume_charge), resuming, proves ? &proven : nullptr);
  return absl::OkStatus();
}

void CoordinatorCore::Seat(Job& job, const Registration& req, uint64_t session_id, std::shared_ptr<RankSink> sink,
                           BufferCharge resume_charge, bool resuming, const RegistrationClaim* proven) {
  GroupSlot& slot = SlotOf(job, req.rank);
  HeldGroup held(job, slot);
  ShardGroup& group = slot.group;
  const Member& m = group.member(req.rank);
  if (!group.has_reference()) group.SetReference(req, options_.promotion);
  group.ForgetMeasures(group.IndexOf(req.rank));  // Its process measures afresh (and resends).
  // The first rank of a group this process has not seen at work resumes: the group waits
  // for all its members (another group's fresh rank may have created the job first).
  if (resuming && group.IsFresh()) {
    GroupEffects fx;
    group.StartRecovery(clock_->Now(), fx);
    Apply(job, group, fx);
  }
  if (resuming && proven == nullptr) {
    Event(Severity::kWarning, EventKind::kResumeUnverified, job.id, req.rank, group.index(),
          "taken as sent: this coordinator has no resume key that outlived the last one (start it with --state-file "
          "or --token-file so that resumes are checked)");
  }
  if (m.live()) Supersede(job, group, m, req);  // CheckJobAccepts let only a newer proven registration here.
  if (group.state() == v1::GROUP_STATE_RECOVERING) {
    ResumeMember(job, group, m, session_id, std::move(sink), req, std::move(resume_charge));
    group.SetClaim(m.rank, proven != nullptr ? *proven : RegistrationClaim{});  // A fresh rank while the group recovers proves nothing.
    return;
  }
  JoinGroup(job, group, m, session_id, std::move(sink), req);
  group.SetClaim(m.rank, proven != nullptr ? *proven : RegistrationClaim{incarnation_, group.binding(m.rank).registration});
}

void CoordinatorCore::Supersede(Job& job, ShardGroup& group, const Member& m, const Registration& req) {
  const std::string why = absl::StrCat(
      "superseded: a process proved a newer registration of rank ", m.rank, " of job '", job.id, "' (incarnation ",
      req.resume->incarnation(), ", registration ", req.resume->previous().registration(),
      ") and resumed it; this session held an older one (incarnation ", m.claim.incarnation, ", registration ",
      m.claim.serial, "). Only the rank's newest process resumes it");
  Event(Severity::kWarning, EventKind::kRankSuperseded, job.id, m.rank, group.index(), why);
  if (group.state() != v1::GROUP_STATE_RECOVERING) {
    RemoveMember(job, m, Leaving::kDead, why);  // Its group re-forms, as for a death.
    return;
  }
  SessionBinding& b = group.binding(m.rank);
  if (b.sink) b.sink->Close(absl::PermissionDeniedError(why));
  b.sink.reset();  // ResumeMember binds the new session in its place.
}

absl::Status CoordinatorCore::CheckRequestAlone(const Registration& req) const {
  // The wire revision before anything else: a worker of another revision is told that, not
  // what its request lacks.
  if (std::string why = WireMismatch(req.wire_revision,
                                     absl::StrCat("rank ", req.rank, " of job '", Printable(req.job_id, 64), "'"));
      !why.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("register: ", why));
  }
  if (absl::Status s = ValidateRegistration(req, options_.limits, options_.max_lookahead); !s.ok()) return s;
  return CheckRootIsPossible(req);
}

void CoordinatorCore::JoinGroup(Job& job, ShardGroup& group, const Member& m, uint64_t session_id,
                                std::shared_ptr<RankSink> sink, const Registration& req) {
  const bool rejoin = m.state == v1::RANK_STATE_DEAD || m.state == v1::RANK_STATE_LEFT;
  SetLive(job, m, session_id, std::move(sink), req);
  v1::CoordinatorMessage msg = Welcome(job, group, m, req, rejoin);
  const int64_t epoch_before = group.epoch();
  GroupEffects fx;
  group.UpdateState(fx);
  msg.mutable_registered()->set_epoch(group.epoch());
  SendTo(m, group.binding(m.rank), msg);  // The RegisterResponse precedes anything else this rank is sent.
  Apply(job, group, fx);
  OnMemberBack(job, req.rank);
  if (group.epoch() != epoch_before) {
    group.AnnounceReformed(req.rank, fx);
    Apply(job, group, fx);
  }
}

absl::StatusOr<Job*> CoordinatorCore::FindOrAdmitJob(const Registration& req, const RegistrationClaim* proven) {
  Job* job = ReuseOrForgetEndedJob(req);
  if (job == nullptr) {
    std::vector<JobTable::Forgotten> forgotten;
    absl::Status admitted = jobs_.Admit(req.job_id, req.world_size, options_.limits, &forgotten);
    for (const JobTable::Forgotten& f : forgotten) Event(Severity::kInfo, EventKind::kJobEvicted, f.id, -1, -1, f.why);
    if (!admitted.ok()) return admitted;
  } else if (absl::Status s = CheckJobAccepts(*job, req, proven); !s.ok()) {
    return s;
  }
  return job;
}

absl::Status CoordinatorCore::CheckResumedRun(const Registration& req) {
  const std::string& claimed = req.resume->previous().run_id();
  std::string current;
  std::string whose;
  if (const Job* job = jobs_.Find(req.job_id); job != nullptr) {
    // Held, ended or not: a resume into an ended job (its ranks resumed and went again before
    // the others came back) continues that run, and no other.
    current = job->run;
    whose = "this coordinator holds";
  } else if (runs_file_.empty()) {
    return absl::OkStatus();  // No state file: the first resume of the job names its run.
  } else if (auto pin = pinned_runs_.find(req.job_id); pin != pinned_runs_.end()) {
    current = pin->second;
    whose = absl::StrCat("the runs file ", runs_file_, " pinned at the last stop");
  } else {
    return absl::PermissionDeniedError(absl::StrCat(
        "register: rank ", req.rank, " of job '", Printable(req.job_id, 64), "' resumes run ", claimed,
        ", but the job had no live run when the last coordinator with state file ", options_.state_file,
        " stopped (", runs_file_, " names none): restart the job (register afresh, without a resume)"));
  }
  if (claimed == current) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "register: rank ", req.rank, " of job '", Printable(req.job_id, 64), "' resumes run ", claimed,
      ", not the job's current run ", current, " (", whose, "): a credential of an earlier run of the same job id "
      "resumes nothing; a rank of the current run resumes with what its worker was given, a new process registers "
      "afresh"));
}

absl::Status CoordinatorCore::RefuseResume(const Registration& req, absl::Status why) {
  Event(Severity::kWarning, EventKind::kResumeRefused, req.job_id, req.rank, -1, std::string(why.message()));
  return why;
}

std::string CoordinatorCore::RunOfNewJob(const Registration& req, bool resuming) {
  std::string run;
  if (resuming && ResumeAuthority::IsRunId(req.resume->previous().run_id())) {
    run = req.resume->previous().run_id();
  } else if (auto pin = pinned_runs_.find(req.job_id); pin != pinned_runs_.end()) {
    run = pin->second;  // A fresh rank of a job that is resuming: the run continues.
  } else {
    run = ResumeAuthority::NewRunId();
  }
  pinned_runs_.erase(req.job_id);  // Claimed: the job's own run is written from now on.
  return run;
}

void CoordinatorCore::SyncRunPins(const Job* joining) {
  if (runs_file_.empty()) return;
  if (clock_->Now() - started_ > options_.recovery_window) pinned_runs_.clear();  // Unclaimed: no resume comes.
  RunPins pins = pinned_runs_;
  for (const auto& [id, job] : jobs_) {
    if (!job->has_ended() || job.get() == joining) pins[id] = job->run;
  }
  if (pins == written_runs_) return;
  // Written under the core's lock, as the set changes (a job starts, ends or is forgotten: rare);
  // after a failure, retried at most every 10 s, so a broken disk is not written at every tick.
  const absl::Time now = clock_->Now();
  if (now < retry_runs_write_) return;
  if (absl::Status s = WriteRunPins(runs_file_, pins); !s.ok()) {
    retry_runs_write_ = now + absl::Seconds(10);
    logging::Get("coordinator")->warn("runs file: {}; after a restart the jobs not written cannot resume (retried "
                                      "in 10 s)", std::string(s.message()));
    return;
  }
  written_runs_ = std::move(pins);
}

absl::Status CoordinatorCore::CheckUnverifiedResumeIsTimely(const Registration& req) {
  if (clock_->Now() - started_ <= options_.recovery_window) return absl::OkStatus();
  // Honest resumes come within seconds of a restart (a worker reconnects for its reconnect
  // window); an unverifiable one long after is no restart's.
  return absl::PermissionDeniedError(absl::StrCat(
      "register: rank ", req.rank, " of job '", req.job_id, "' resumes from an earlier coordinator ",
      absl::ToInt64Seconds(clock_->Now() - started_), " s after this one started: without a resume key (--state-file "
      "or --token-file) a resume is taken unverified only within the recovery window (",
      absl::ToInt64Milliseconds(options_.recovery_window), " ms) after a start; register afresh"));
}

v1::CoordinatorMessage CoordinatorCore::Welcome(const Job& job, const ShardGroup& group, const Member& m,
                                                const Registration& req, bool rejoin) {
  v1::CoordinatorMessage msg = group.Registered(req, incarnation_, config_digest_);
  const SessionBinding& b = group.binding(m.rank);
  msg.mutable_registered()->set_session_key(b.session_key);
  msg.mutable_registered()->set_resume_credential(job.run_auth->Credential(job.id, req.rank, incarnation_, b.registration));
  msg.mutable_registered()->set_run_id(job.run);
  msg.mutable_registered()->set_registration(b.registration);
  const Policy policy = req.policy;
  Event(Severity::kInfo, rejoin ? EventKind::kRankRejoined : EventKind::kRankRegistered, job.id, req.rank, group.index(),
        absl::StrCat("host=", req.host, " policy=", PolicyName(policy),
                     " fallback=", FallbackName(req.fallback), " modules=", req.modules.size(),
                     " lookahead=", req.lookahead));
  if (policy == Policy::kPerLayer) {
    Event(Severity::kWarning, EventKind::kPerLayerRequested, job.id, req.rank, group.index(), msg.registered().warnings(0));
  }
  return msg;
}

Job* CoordinatorCore::ReuseOrForgetEndedJob(const Registration& req) {
  Job* job = jobs_.Find(req.job_id);
  if (job == nullptr || !job->has_ended()) return job;
  // Every rank of the job left or died: this registration is a rerun or a restart from a
  // checkpoint. With another size the job starts afresh; with the same size it keeps its
  // history (communicator epochs, events, counts), and each group takes the manifest and
  // policy of its first rank to register again.
  if (job->world_size != req.world_size || job->group_size != req.group_size) {
    Event(Severity::kInfo, EventKind::kJobReplaced, job->id, req.rank, -1,
          absl::StrCat("no rank was live: the job starts afresh with world_size ", req.world_size,
                       " and group_size ", req.group_size));
    jobs_.Erase(req.job_id);
    return nullptr;
  }
  // A rerun plans its keys from the start again: each group begins a new epoch with no
  // microbatch resolved (else every plan of the rerun is "stale" until job_retention_ms
  // forgets the job).
  // A new run: credentials and seals of the ended one resume nothing in it. Unless a rank of
  // that run resumes it (CheckResumedRun verified the run): then the run goes on.
  job->started = clock_->Now();
  const bool same_run = req.resume.has_value() && req.resume->incarnation() != incarnation_ &&
                        req.resume->previous().run_id() == job->run;
  if (!same_run) {
    job->run = ResumeAuthority::NewRunId();
    job->run_auth = std::make_unique<const ResumeAuthority>(resume_auth_.ForRun(job->id, job->run));
  }
  for (const auto& slot : job->groups) {
    HeldGroup held(*job, *slot);
    slot->group.StartRerun(job->run_auth.get());
  }
  Event(Severity::kInfo, EventKind::kJobRerun, job->id, req.rank, -1,
        "every rank had left: the job runs again under the same id and sizes, its keys from the start");
  return job;
}

absl::Status CoordinatorCore::CheckJobAccepts(const Job& job, const Registration& req,
                                              const RegistrationClaim* proven) const {
  if (job.world_size != req.world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "register: world size mismatch: job '", job.id, "' has world_size ", job.world_size,
        " but rank ", req.rank, " registered with ", req.world_size,
        "; every rank of a job must pass the same world size"));
  }
  if (job.group_size != req.group_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "register: group size mismatch: job '", job.id, "' has group_size ", job.group_size,
        " but rank ", req.rank, " registered with ", req.group_size));
  }
  GroupSlot& slot = SlotOf(job, req.rank);
  HeldGroup held(job, slot);
  ShardGroup& g = slot.group;  // Not const: the analysis follows a reference only without a conversion.
  const Member& existing = g.member(req.rank);
  if (proven != nullptr && existing.claim.incarnation != 0 && *proven < existing.claim) {
    return absl::PermissionDeniedError(absl::StrCat(
        "register: rank ", req.rank, " of job '", job.id, "' resumes its registration ", proven->serial,
        " of coordinator incarnation ", proven->incarnation, ", but the rank's slot was since held by registration ",
        existing.claim.serial, " of incarnation ", existing.claim.incarnation,
        ": an older registration of a rank resumes nothing; only the rank's newest process resumes it"));
  }
  if (existing.state == v1::RANK_STATE_LIVE && !(proven != nullptr && existing.claim < *proven)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "register: duplicate rank ", req.rank, " of job '", job.id,
        "': it is already live (host ", existing.host,
        "). If that process is gone, it is declared dead after the heartbeat timeout (",
        absl::ToInt64Milliseconds(options_.heartbeat_timeout),
        " ms); register again then"));
  }
  if (!g.has_reference()) return absl::OkStatus();
  return CheckSameAsReference(g.reference(), g.reference_rank(), req,
                              absl::StrCat(" (job '", job.id, "', group ", g.index(), ")"));
}

Job& CoordinatorCore::CreateJob(const Registration& req, const std::string& run) {
  Job& job = jobs_.Create(req.job_id, req.world_size, req.group_size, GroupRules{req.job_id, &options_, &resume_auth_},
                          run, buffers_.get());
  job.started = clock_->Now();
  const bool no_modules = req.modules.empty();
  Event(no_modules ? Severity::kWarning : Severity::kInfo, EventKind::kJobCreated, job.id, -1, -1,
        absl::StrCat("world_size=", job.world_size, " group_size=", job.group_size, " groups=", job.groups.size(),
                     " modules=", req.modules.size(),
                     no_modules ? " (no controlled module: nothing is coordinated; the ranks' manifest is empty)" : ""));
  return job;
}

}  // namespace shardcoord::coordinator
