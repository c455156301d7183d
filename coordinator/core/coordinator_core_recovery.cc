// CoordinatorCore: recovery after a coordinator restart (DESIGN 12). A group the new process
// first hears of from a resuming rank starts RECOVERING; it waits
// until every member has resumed and reported what it holds, then applies the rule of
// recovery.h: held decisions are binding and re-sent unchanged, contradictions fail the
// group, keys nobody holds are decided afresh once every member reported them.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/daemon_metrics.h"
#include "coordinator/core/recovery.h"
#include "coordinator/core/text.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {
bool CoordinatorCore::IsFreshGroup(const Job& job, const ShardGroup& group) const {
  if (group.state != v1::GROUP_STATE_FORMING || group.epoch != 0 || group.last_decided) return false;
  return group.Count().live == 0;
}

void CoordinatorCore::StartRecovery(Job& job, ShardGroup& group) {
  group.state = v1::GROUP_STATE_RECOVERING;
  group.recovery_deadline = clock_->Now() + options_.recovery_window;
  Event("warning", EventKind::kGroupRecovering, job.id, -1, group.index,
        absl::StrCat("a rank resumed after a coordinator restart: the group waits up to ",
                     absl::ToInt64Milliseconds(options_.recovery_window),
                     " ms for its members to report what they hold"));
}

absl::StatusOr<BufferCharge> CoordinatorCore::ChargeResume(const v1::RegisterRequest& req) {
  // Held until the group recovers (up to recovery_window_ms): its memory, not its wire size.
  const auto bytes = static_cast<int64_t>(req.resume().SpaceUsedLong());
  if (!buffers_->TryTakeStrict(bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: the resume of rank ", req.rank(), " of job '", req.job_id(), "' would be held in ", bytes,
        " bytes until its group recovers, and the daemon's buffers for all clients hold ", buffers_->used(),
        " of max_buffered_bytes ", buffers_->limit(), "; the worker retries within its reconnect window (raise "
        "max_buffered_bytes if honest resumes of this size are refused)"));
  }
  return BufferCharge(buffers_.get(), bytes);
}

void CoordinatorCore::ResumeMember(Job& job, ShardGroup& group, Member& m, uint64_t session_id,
                                   std::shared_ptr<RankSink> sink, const v1::RegisterRequest& req,
                                   BufferCharge charge) {
  SetLive(job, m, session_id, std::move(sink), req);
  // A rank that never registered before the restart holds nothing.
  m.resume = req.has_resume() ? req.resume() : v1::ResumeState{};
  m.resume_charge = std::move(charge);
  v1::CoordinatorMessage msg = Registered(group, req);
  msg.mutable_registered()->set_epoch(m.resume->group_epoch());
  msg.mutable_registered()->set_session_key(m.session_key);
  msg.mutable_registered()->set_resume_credential(resume_auth_.Credential(job.id, m.rank));
  Event("info", EventKind::kRankResumed, job.id, m.rank, group.index,
        absl::StrCat("from incarnation ", m.resume->incarnation(), " at epoch ", m.resume->group_epoch(), ", holding ",
                     m.resume->held_size(), " decisions and ", m.resume->undecided_size(), " undecided plans"));
  SendTo(m, msg);
  if (req.has_resume()) ResumeComms(job, m.rank, req.resume());
  const bool all_back = std::all_of(group.members.begin(), group.members.end(),
                                    [](const Member& x) { return x.live() && x.resume.has_value(); });
  if (all_back) FinishRecovery(job, group);
}

void CoordinatorCore::FinishRecovery(Job& job, ShardGroup& group) {
  std::vector<MemberResume> reports;
  for (Member& m : group.members) {
    reports.push_back({m.rank, std::move(*m.resume)});
    m.resume.reset();
    m.resume_charge = BufferCharge();
  }
  GroupRecovery rec = PlanGroupRecovery(group.index, reports);
  group.recovery_deadline = absl::InfiniteFuture();
  if (!rec.status.ok()) {
    group.epoch = rec.epoch;
    FailRecovery(job, group, std::string(rec.status.message()));
    return;
  }
  group.epoch = rec.epoch;
  group.state = v1::GROUP_STATE_HEALTHY;
  group.formed = true;
  group.SetPromotionBudget();  // The group's engine is this process's own: restore its state.
  group.engine->Restore(rec.next_seq, rec.promoted, rec.sticky);
  for (auto& [key, d] : rec.binding) RecordDecision(job, group, d);
  if (!rec.binding.empty()) group.last_resolved = rec.binding.rbegin()->first;
  for (Member& m : group.members) {  // Out-of-order checks go on from what each rank received.
    for (auto& [key, holders] : rec.holders) {
      if (holders.count(m.rank) && (!m.last_planned || *m.last_planned < key)) m.last_planned = key;
    }
  }
  for (const auto& [rank, d] : rec.resend) {
    Member& m = group.member(rank);
    if (!m.last_planned || *m.last_planned < KeyOf(d)) m.last_planned = KeyOf(d);
    QueueDecision(m, d);
  }
  if (group.engine->is_static()) {
    for (const auto& [key, d] : rec.binding) KeepStaticBinding(job, group, key, d);
  }
  for (const auto& [rank, key] : rec.lost) {
    v1::CoordinatorMessage msg;
    auto* f = msg.mutable_microbatch_failed();
    f->set_group(group.index);
    f->set_step(key.step);
    f->set_microbatch(key.microbatch);
    f->set_code(static_cast<int>(absl::StatusCode::kAborted));
    f->set_message(absl::StrCat("microbatch ", key.ToString(), " of group ", group.index,
                                ": its decision was lost in the coordinator restart (no member holds it any more)"));
    SendTo(group.member(rank), msg);
  }
  metrics_->ObserveGroupRecovery(clock_->Now() - started_);
  Event("info", EventKind::kGroupRecovered, job.id, -1, group.index,
        absl::StrCat("epoch ", group.epoch, ": ", rec.binding.size(), " held decisions kept, ", rec.resend.size(),
                     " re-sent, ", rec.undecided.size(), " plans to decide, ", rec.lost.size(), " lost; seq goes on from ",
                     rec.next_seq, rec.promoted.empty() ? "" : absl::StrCat("; promoted: ", NameList(std::vector<std::string>(rec.promoted.begin(), rec.promoted.end())))));
  ReplayPlans(job, group, rec.undecided);
  auto deferred = std::move(group.deferred_plans);
  group.deferred_plans.clear();
  ReplayPlans(job, group, deferred);
}

void CoordinatorCore::KeepStaticBinding(Job& job, ShardGroup& group, const MicrobatchKey& key,
                                        const v1::MicrobatchDecision& d) {
  const int size = group.size();
  PendingMicrobatch p;  // Shaped as ShardGroup::Report makes one: later reports fill it in.
  p.calls.assign(group.modules.size(), std::vector<int32_t>(size, 0));
  p.reported.assign(size, false);
  p.first_report = clock_->Now();
  p.decided = d;
  for (int i = 0; i < size; ++i) {
    const Member& m = group.members[i];
    if (m.last_planned && key <= *m.last_planned) {
      p.reported[i] = true;
      p.num_reported++;
    }
  }
  if (p.num_reported == size) return;  // Every member has it: nothing left to hand out.
  group.pending[key] = std::move(p);
}

void CoordinatorCore::ReplayPlans(Job& job, ShardGroup& group, const std::vector<std::pair<int, v1::MicrobatchPlan>>& plans) {
  for (const auto& [rank, plan] : plans) {
    Member& m = group.member(rank);
    if (!m.live()) continue;
    absl::Status s = AcceptPlan(job, group, m, plan);
    if (!s.ok()) SendTo(m, PlanRejectedMessage(plan, s, group.epoch));
  }
  Flush(group);
}

void CoordinatorCore::FailRecovery(Job& job, ShardGroup& group, const std::string& why) {
  group.state = v1::GROUP_STATE_FAILED;
  group.failure_reason = why;
  group.pending.clear();
  group.deferred_plans.clear();
  v1::CoordinatorMessage msg;
  auto* gf = msg.mutable_group_failure();
  gf->set_group(group.index);
  gf->set_epoch(group.epoch);
  gf->set_reason(absl::StrCat("group ", group.index, " of job '", job.id, "' failed at epoch ", group.epoch, ": ", why));
  for (Member& m : group.members) SendTo(m, msg);
  Event("error", EventKind::kGroupRecoveryFailed, job.id, -1, group.index, why);
  // Every member is live: the group re-forms at once in a new epoch, keys start afresh.
  UpdateGroupState(job, group);
  v1::CoordinatorMessage notice;
  notice.mutable_notice()->set_kind(v1::Notice::KIND_GROUP_REFORMED);
  notice.mutable_notice()->set_group(group.index);
  notice.mutable_notice()->set_epoch(group.epoch);
  notice.mutable_notice()->set_message(
      absl::StrCat("group ", group.index, " re-formed at epoch ", group.epoch, " after its recovery failed"));
  for (Member& m : group.members) SendTo(m, notice);
}

void CoordinatorCore::ExpireRecovery(Job& job, absl::Time now) {
  for (size_t g = 0; g < job.groups.size(); ++g) {
    ShardGroup& group = Owned(job, static_cast<int>(g));
    if (group.state != v1::GROUP_STATE_RECOVERING || now < group.recovery_deadline) continue;
    std::vector<int> missing;
    for (const Member& m : group.members) {
      if (!m.live()) missing.push_back(m.rank);
    }
    // One event for the group, naming the missing ranks (capped), and a short reason per rank:
    // the work and the text stay linear in the group, however many ranks did not come back.
    const std::string window = absl::StrCat("the recovery window (", absl::ToInt64Milliseconds(options_.recovery_window),
                                            " ms, --recovery-window-ms) after the coordinator restarted");
    const std::string why = absl::StrCat(missing.size(), " of ", group.ranks.size(), " ranks (",
                                         RankList(missing), ") did not resume within ", window);
    group.state = v1::GROUP_STATE_FAILED;
    group.recovery_deadline = absl::InfiniteFuture();
    group.deferred_plans.clear();
    for (Member& m : group.members) {
      m.resume.reset();
      m.resume_charge = BufferCharge();
    }
    if (!missing.empty()) Event("error", EventKind::kRecoveryExpired, job.id, -1, group.index, why);
    const std::string each = absl::StrCat("did not resume within ", window);
    for (int r : missing) {
      Member& m = group.member(r);
      m.state = v1::RANK_STATE_DEAD;
      m.dead_reason = each;
      OnMemberLost(job, r, /*clean=*/false, each);
    }
    if (!missing.empty()) FailGroup(job, group, group.member(missing.front()), why);
  }
}

}  // namespace shardcoord::coordinator
