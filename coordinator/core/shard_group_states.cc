// ShardGroup: its state machine (DESIGN 8): forming, failing when a member dies, re-forming in
// a new epoch, what a clean leave costs; and recovery after a coordinator restart (DESIGN 12):
// a group the new process first hears of from a resuming rank waits until every member has
// resumed and reported what it holds, then applies the rule of recovery.h: held decisions are
// binding and re-sent unchanged, contradictions fail the group, keys nobody holds are decided
// afresh once every member reported them.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/core/invariant.h"
#include "coordinator/engine/recovery.h"
#include "coordinator/core/shard_group.h"
#include "coordinator/engine/text.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {

void ShardGroup::UpdateState(GroupEffects& fx) {
  const auto [live, left, dead] = Count();
  const v1::GroupState before = state_;
  // Recovering after a restart: FinishRecovery or ExpireRecovery ends it, or a death.
  if (before == v1::GROUP_STATE_RECOVERING && dead == 0) return;
  const bool reforming = before == v1::GROUP_STATE_FAILED || before == v1::GROUP_STATE_FINISHED;
  if (dead > 0) {
    state_ = v1::GROUP_STATE_FAILED;
  } else if (left == size()) {
    state_ = v1::GROUP_STATE_FINISHED;
  } else if (reforming && live < size()) {
    // After a failure (or after everyone left) the group re-forms only once every member
    // is live again: members that merely left would make it decide for ranks not there.
    state_ = v1::GROUP_STATE_FORMING;
    failure_reason_.clear();
  } else if (live + left < size()) {
    // Some member never registered (it may have died before it did).
    state_ = v1::GROUP_STATE_FORMING;
  } else if (before == v1::GROUP_STATE_FORMING && !formed_) {
    // Formed for the first time: the promotion budget is known now. (Under root or replicate
    // its first members may have been given decisions already: they need no group.)
    state_ = v1::GROUP_STATE_HEALTHY;
    formed_ = true;
    const int64_t min_budget = SetPromotionBudget();
    fx.Record(Severity::kInfo, EventKind::kGroupFormed, -1,
              absl::StrCat("ranks ", RankList(ranks_), " policy=", PolicyName(engine_->config().policy),
                           " fallback=", FallbackName(engine_->config().fallback),
                           " min_memory_budget_bytes=", min_budget));
  } else if (before != v1::GROUP_STATE_HEALTHY) {
    // Whole again after a failure: a new epoch. Microbatch keys start afresh (a job
    // resumed from a checkpoint plans earlier steps again). The seq goes on, for every policy.
    epoch_++;
    failure_reason_.clear();
    RestartKeys();
    if (engine_->config().min_memory_budget_bytes == 0 && engine_->next_seq() == 0) {
      SetPromotionBudget();  // Whole for the first time through a failure.
    }
    state_ = v1::GROUP_STATE_HEALTHY;
    formed_ = true;
    fx.Record(Severity::kInfo, EventKind::kGroupReformed, -1, absl::StrCat("epoch ", epoch_, " ranks ", RankList(ranks_)));
  }
}

namespace {

v1::CoordinatorMessage Reformed(int group, int64_t epoch, const std::string& why) {
  v1::CoordinatorMessage notice;
  notice.mutable_notice()->set_kind(v1::Notice::KIND_GROUP_REFORMED);
  notice.mutable_notice()->set_group(group);
  notice.mutable_notice()->set_epoch(epoch);
  notice.mutable_notice()->set_message(absl::StrCat("group ", group, " re-formed at epoch ", epoch, " ", why));
  return notice;
}

}  // namespace

v1::CoordinatorMessage ShardGroup::GroupFailed(const std::string& why) const {
  v1::CoordinatorMessage msg;
  auto* gf = msg.mutable_group_failure();
  gf->set_group(index_);
  gf->set_epoch(epoch_);
  gf->set_reason(absl::StrCat("group ", index_, " of job '", rules_.job_id, "' failed at epoch ", epoch_, ": ", why));
  return msg;
}

void ShardGroup::AnnounceReformed(int rank, GroupEffects& fx) {
  const v1::CoordinatorMessage notice = Reformed(index_, epoch_, absl::StrCat("(rank ", rank, " registered again)"));
  for (int i = 0; i < size(); ++i) {
    if (ranks_[i] != rank) fx.Send(i, notice);
  }
}

void ShardGroup::OnLeft(int idx, absl::Time now, GroupEffects& fx) {
  // Pending microbatches it never reported can never be decided.
  std::vector<MicrobatchKey> doomed;
  for (const auto& [k, p] : pending_) {
    if (!p.reported[idx]) doomed.push_back(k);
  }
  for (const auto& k : doomed) {
    FailMicrobatch(k,
                   absl::FailedPreconditionError(absl::StrCat("microbatch ", k.ToString(), " of group ", index_,
                                                              " can never be decided: rank ", ranks_[idx],
                                                              " left the job without planning it")),
                   fx);
  }
  UpdateState(fx);
  Drain(now, fx);
}

void ShardGroup::DropResumes() {
  for (Member& m : members_) {
    m.resume.reset();
    m.resume_charge = BufferCharge();
  }
}

std::string ShardGroup::Fail(int idx, const std::string& full, GroupEffects& fx) {
  SHARDCOORD_INVARIANT(members_[idx].state == v1::RANK_STATE_DEAD,
                       absl::StrCat("group ", index_, " fails for rank ", ranks_[idx], ", which is not marked dead"));
  // A death fails the group: cancel everything pending and tell every live member.
  const bool was_failed = state_ == v1::GROUP_STATE_FAILED;
  // Whole again, it re-forms in a new epoch with a notice, even if it never formed before:
  // its live members hold this failure until they hear of the re-form.
  formed_ = true;
  if (state_ == v1::GROUP_STATE_RECOVERING) {
    DropResumes();  // The recovery is over: what the members resumed with is held no longer,
    deferred_plans_.clear();  // nor the plans it held back (the members plan again after the re-form).
    recovery_deadline_ = absl::InfiniteFuture();
  }
  failure_reason_ = was_failed && !failure_reason_.empty() ? absl::StrCat(failure_reason_, "; ", full) : full;
  v1::CoordinatorMessage msg = GroupFailed(failure_reason_);
  auto* gf = msg.mutable_group_failure();
  for (const Member& m : members_) {
    if (m.state == v1::RANK_STATE_DEAD) gf->add_dead_ranks(m.rank);
  }
  for (const auto& [k, p] : pending_) ToProto(k, gf->add_cancelled());
  pending_.clear();
  UpdateState(fx);
  std::string reason = gf->reason();
  fx.Record(Severity::kError, EventKind::kGroupFailed, ranks_[idx],
            absl::StrCat(reason, "; cancelled ", gf->cancelled_size(), " pending microbatches"));
  fx.Send(GroupEffects::kEveryMember, std::move(msg));
  return reason;
}

bool ShardGroup::IsFresh() const {
  if (state_ != v1::GROUP_STATE_FORMING || epoch_ != 0 || last_decided_) return false;
  return Count().live == 0;
}

void ShardGroup::StartRecovery(absl::Time now, GroupEffects& fx) {
  const absl::Duration window = rules_.options->recovery_window;
  state_ = v1::GROUP_STATE_RECOVERING;
  recovery_deadline_ = now + window;
  fx.Record(Severity::kWarning, EventKind::kGroupRecovering, -1,
            absl::StrCat("a rank resumed after a coordinator restart: the group waits up to ",
                         absl::ToInt64Milliseconds(window), " ms for its members to report what they hold"));
}

void ShardGroup::MaybeFinishRecovery(absl::Time now, GroupEffects& fx) {
  const bool all_back =
      std::all_of(members_.begin(), members_.end(), [](const Member& x) { return x.live() && x.resume.has_value(); });
  if (all_back) FinishRecovery(now, fx);
}

namespace {

std::string Recovered(int64_t epoch, const GroupRecovery& rec) {
  return absl::StrCat(
      "epoch ", epoch, ": ", rec.binding.size(), " held decisions kept, ", rec.resend.size(), " re-sent, ",
      rec.undecided.size(), " plans to decide, ", rec.lost.size(), " lost; seq goes on from ", rec.next_seq,
      rec.promoted.empty()
          ? ""
          : absl::StrCat("; promoted: ", NameList(std::vector<std::string>(rec.promoted.begin(), rec.promoted.end()))));
}

}  // namespace

void ShardGroup::FinishRecovery(absl::Time now, GroupEffects& fx) {
  std::vector<MemberResume> reports;
  for (Member& m : members_) reports.push_back({m.rank, std::move(*m.resume)});
  DropResumes();
  GroupRecovery rec = PlanGroupRecovery(index_, reports);
  recovery_deadline_ = absl::InfiniteFuture();
  epoch_ = rec.epoch;
  if (!rec.status.ok()) {
    FailRecovery(std::string(rec.status.message()), fx);
    return;
  }
  state_ = v1::GROUP_STATE_HEALTHY;
  formed_ = true;
  SetPromotionBudget();  // The group's engine is this process's own: restore its state.
  engine_->Restore(rec.next_seq, rec.promoted, rec.sticky);
  for (auto& [key, d] : rec.binding) Given(d, fx);
  if (!rec.binding.empty()) last_resolved_ = rec.binding.rbegin()->first;
  for (Member& m : members_) {  // Out-of-order checks go on from what each rank received.
    for (auto& [key, holders] : rec.holders) {
      if (holders.count(m.rank) && (!m.last_planned || *m.last_planned < key)) m.last_planned = key;
    }
  }
  for (const auto& [rank, d] : rec.resend) {
    Member& m = mutable_member(rank);
    if (!m.last_planned || *m.last_planned < KeyOf(d)) m.last_planned = KeyOf(d);
    fx.Decide(IndexOf(rank), d);
  }
  if (engine_->is_static()) {
    for (const auto& [key, d] : rec.binding) KeepStaticBinding(key, d, now);
  }
  for (const auto& [rank, key] : rec.lost) {
    fx.Send(IndexOf(rank), MicrobatchFailed(key, absl::AbortedError(absl::StrCat(
                                                     "microbatch ", key.ToString(), " of group ", index_,
                                                     ": its decision was lost in the coordinator restart (no member "
                                                     "holds it any more)"))));
  }
  fx.recovered = true;
  fx.Record(Severity::kInfo, EventKind::kGroupRecovered, -1, Recovered(epoch_, rec));
  ReplayPlans(rec.undecided, now, fx);
  auto deferred = std::move(deferred_plans_);
  deferred_plans_.clear();
  ReplayPlans(deferred, now, fx);
}

void ShardGroup::KeepStaticBinding(const MicrobatchKey& key, const v1::MicrobatchDecision& d, absl::Time now) {
  PendingMicrobatch p;  // Shaped as Report makes one: later reports fill it in.
  p.calls.assign(modules_.size(), std::vector<int32_t>(size(), 0));
  p.reported.assign(size(), false);
  p.first_report = now;
  p.decided = d;
  for (int i = 0; i < size(); ++i) {
    const Member& m = members_[i];
    if (m.last_planned && key <= *m.last_planned) {
      p.reported[i] = true;
      p.num_reported++;
    }
  }
  if (p.num_reported == size()) return;  // Every member has it: nothing left to hand out.
  pending_[key] = std::move(p);
}

void ShardGroup::ReplayPlans(const std::vector<std::pair<int, MicrobatchPlan>>& plans, absl::Time now,
                             GroupEffects& fx) {
  for (const auto& [rank, plan] : plans) {
    const int idx = IndexOf(rank);
    if (!members_[idx].live()) continue;
    if (absl::Status s = AcceptPlan(idx, plan, now, fx); !s.ok()) Reject(idx, plan.key, s, epoch_, fx);
  }
}

void ShardGroup::FailRecovery(const std::string& why, GroupEffects& fx) {
  state_ = v1::GROUP_STATE_FAILED;
  failure_reason_ = why;
  pending_.clear();
  deferred_plans_.clear();
  fx.Send(GroupEffects::kEveryMember, GroupFailed(why));
  fx.Record(Severity::kError, EventKind::kGroupRecoveryFailed, -1, why);
  // Every member is live: the group re-forms at once in a new epoch, keys start afresh.
  UpdateState(fx);
  fx.Send(GroupEffects::kEveryMember, Reformed(index_, epoch_, "after its recovery failed"));
}

std::vector<int> ShardGroup::ExpireRecovery(absl::Time now, std::string* why, std::string* each, GroupEffects& fx) {
  if (state_ != v1::GROUP_STATE_RECOVERING || now < recovery_deadline_) return {};
  std::vector<int> missing;
  for (const Member& m : members_) {
    if (!m.live()) missing.push_back(m.rank);
  }
  // One event for the group, naming the missing ranks (capped), and a short reason per rank:
  // the work and the text stay linear in the group, however many ranks did not come back.
  const std::string window = absl::StrCat("the recovery window (",
                                          absl::ToInt64Milliseconds(rules_.options->recovery_window),
                                          " ms, --recovery-window-ms) after the coordinator restarted");
  *why = absl::StrCat(missing.size(), " of ", ranks_.size(), " ranks (", RankList(missing), ") did not resume within ",
                      window);
  *each = absl::StrCat("did not resume within ", window);
  if (missing.empty()) {
    // Every member is live yet one has not resumed: not reachable (a rank joining a recovering
    // group always resumes, ResumeMember), so a bug; the group re-forms instead of staying
    // FAILED with no event and no notice.
    SHARDCOORD_INVARIANT(false, absl::StrCat("group ", index_, " is past its recovery deadline with every member live"));
    DropResumes();
    recovery_deadline_ = absl::InfiniteFuture();
    FailRecovery(absl::StrCat("every member is live but not every one resumed within ", window), fx);
    return {};
  }
  state_ = v1::GROUP_STATE_FAILED;
  recovery_deadline_ = absl::InfiniteFuture();
  deferred_plans_.clear();
  DropResumes();
  fx.Record(Severity::kError, EventKind::kRecoveryExpired, -1, *why);
  for (int r : missing) {
    mutable_member(r).state = v1::RANK_STATE_DEAD;
    mutable_member(r).dead_reason = *each;
  }
  return missing;
}

void ShardGroup::MemberLive(int rank, const Registration& req, absl::Time now) {
  Member& m = mutable_member(rank);
  m.state = v1::RANK_STATE_LIVE;
  m.dead_reason.clear();
  m.host = req.host;
  m.pid = req.pid;
  m.last_seen = now;
  m.last_planned.reset();
  m.resume.reset();  // A resume is held only from HoldResume on (the core calls it after this).
  m.resume_charge = BufferCharge();
  m.registrations++;
  m.lookahead = req.lookahead;
  m.memory_budget = req.memory_budget_bytes;
}

void ShardGroup::MemberSeen(int rank, absl::Time now) { mutable_member(rank).last_seen = now; }

void ShardGroup::SetClaim(int rank, const RegistrationClaim& claim) { mutable_member(rank).claim = claim; }

void ShardGroup::HoldResume(int rank, v1::ResumeState resume, BufferCharge charge) {
  Member& m = mutable_member(rank);
  m.resume = std::move(resume);
  m.resume_charge = std::move(charge);
}

int ShardGroup::RestartHeartbeatDeadlines(absl::Time now) {
  int live = 0;
  for (Member& m : members_) {
    if (!m.live()) continue;
    m.last_seen = std::max(m.last_seen, now);
    ++live;
  }
  return live;
}

void ShardGroup::MemberGone(int rank, bool clean, const std::string& reason) {
  Member& m = mutable_member(rank);
  m.state = clean ? v1::RANK_STATE_LEFT : v1::RANK_STATE_DEAD;
  m.dead_reason = reason;
}

void ShardGroup::StartRerun(const ResumeAuthority* run_auth) {
  // A new run: what its members' holders proved belongs to the ended run (RegistrationClaim).
  if (run_auth != rules_.auth) {
    for (Member& m : members_) m.claim = RegistrationClaim{};
  }
  rules_.auth = run_auth;
  has_reference_ = false;
  formed_ = false;  // A rerun forms its groups afresh.
  // The ended run's members wait to come back, as in a forming job: one that has not
  // registered again yet is not "left" (its plans are still to come), or the first rank's
  // plans would fail as never decidable and the next ones' be stale.
  for (Member& m : members_) {
    if (m.state != v1::RANK_STATE_LIVE) {
      m.state = v1::RANK_STATE_UNREGISTERED;
      m.dead_reason.clear();
    }
  }
  RestartKeys();
  deferred_plans_.clear();
  last_decided_.reset();  // The group re-forms in a new epoch once its members are back.
}

}  // namespace shardcoord::coordinator
