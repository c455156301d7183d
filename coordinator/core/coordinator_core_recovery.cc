// CoordinatorCore: recovery after a coordinator restart (DESIGN 12), the core's share: a
// resuming rank's session, its resume charged to the daemon's buffers and its communicators;
// the recovery window's end. The group's rule (wait for every member, then held decisions
// binding, contradictions fail) is ShardGroup's (shard_group_states.cc).
#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"

namespace shardcoord::coordinator {

absl::StatusOr<BufferCharge> CoordinatorCore::ChargeResume(const Registration& req) {
  // Held until the group recovers (up to recovery_window_ms): its memory, not its wire size.
  const auto bytes = static_cast<int64_t>(req.resume->SpaceUsedLong());
  if (!buffers_->TryTakeStrict(bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: the resume of rank ", req.rank, " of job '", req.job_id, "' would be held in ", bytes,
        " bytes until its group recovers, and the daemon's buffers for all clients hold ", buffers_->used(),
        " of max_buffered_bytes ", buffers_->limit(), "; the worker retries within its reconnect window (raise "
        "max_buffered_bytes if honest resumes of this size are refused)"));
  }
  return BufferCharge(buffers_.get(), bytes);
}

void CoordinatorCore::ResumeMember(Job& job, ShardGroup& group, const Member& m, uint64_t session_id,
                                   std::shared_ptr<RankSink> sink, const Registration& req,
                                   BufferCharge charge) {
  SetLive(job, m, session_id, std::move(sink), req);
  // A rank that never registered before the restart holds nothing.
  group.HoldResume(m.rank, req.resume.has_value() ? *req.resume : v1::ResumeState{}, std::move(charge));
  v1::CoordinatorMessage msg = group.Registered(req, incarnation_, config_digest_);
  msg.mutable_registered()->set_epoch(m.resume->group_epoch());
  SessionBinding& b = group.binding(m.rank);
  msg.mutable_registered()->set_session_key(b.session_key);
  msg.mutable_registered()->set_resume_credential(job.run_auth->Credential(job.id, m.rank, incarnation_, b.registration));
  msg.mutable_registered()->set_run_id(job.run);
  msg.mutable_registered()->set_registration(b.registration);
  Event(Severity::kInfo, EventKind::kRankResumed, job.id, m.rank, group.index(),
        absl::StrCat("from incarnation ", m.resume->incarnation(), " at epoch ", m.resume->group_epoch(), ", holding ",
                     m.resume->held_size(), " decisions and ", m.resume->undecided_size(), " undecided plans"));
  SendTo(m, b, msg);
  if (req.resume.has_value()) ResumeComms(job, m.rank, *req.resume);
  GroupEffects fx;
  group.MaybeFinishRecovery(clock_->Now(), fx);
  Apply(job, group, fx);
}

void CoordinatorCore::ExpireRecovery(Job& job, absl::Time now) {
  for (const auto& slot : job.groups) {
    HeldGroup held(job, *slot);
    ShardGroup& group = slot->group;
    GroupEffects fx;
    std::string why, each;
    const std::vector<int> missing = group.ExpireRecovery(now, &why, &each, fx);
    Apply(job, group, fx);
    for (int r : missing) OnMemberLost(job, r, /*clean=*/false, each);
    if (!missing.empty()) FailGroup(job, group, group.IndexOf(missing.front()), why);
  }
}

}  // namespace shardcoord::coordinator
