#include "coordinator/core/comm_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/core/invariant.h"
#include "coordinator/engine/text.h"

namespace shardcoord::coordinator {
namespace {

constexpr absl::Duration kDefaultCommWait = absl::Seconds(60);
constexpr absl::Duration kMaxCommWait = absl::Minutes(30);
// What a store entry costs beyond its key and value (the map node, two strings).
constexpr int64_t kStoreEntryOverhead = 128;

absl::Duration WaitFor(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return kDefaultCommWait;
  return std::min(timeout, kMaxCommWait);
}

// Completes a waiting call once the core's lock is released.
template <typename Done, typename Result>
void Complete(CommHost& host, Done& done, Result result) {
  host.Defer([done = std::move(done), result = std::move(result)] { done(result); });
}

}  // namespace

CommTable::CommTable(std::string job_id, int world_size, int group_size, const CoordinatorLimits& limits,
                     absl::Duration behind_threshold, BufferBudget* buffers)
    : job_id_(std::move(job_id)),
      world_size_(world_size),
      group_size_(group_size),
      limits_(limits),
      buffers_(buffers),
      behind_threshold_(behind_threshold) {}

absl::StatusOr<std::vector<int>> CommTable::Members(const std::string& name, const std::vector<int>& ranks) const {
  if (name.empty()) return absl::InvalidArgumentError("communicator name is empty");
  if (std::string bad = ControlCharacterIn(name); !bad.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("communicator name '", Printable(name, 64), "' has a control character (",
                                                   bad, "); names must be printable"));
  }
  std::vector<int> members;
  const int groups = world_size_ / group_size_;
  if (name == "world") {
    for (int r = 0; r < world_size_; ++r) members.push_back(r);
  } else if (name.rfind("group/", 0) == 0) {
    int g = -1;
    if (!absl::SimpleAtoi(name.substr(6), &g) || g < 0 || g >= groups) {
      return absl::InvalidArgumentError(absl::StrCat("communicator '", name, "': job '", job_id_, "' has groups 0..",
                                                     groups - 1));
    }
    for (int r = g * group_size_; r < (g + 1) * group_size_; ++r) members.push_back(r);
  } else {
    members = ranks;
    if (members.empty()) {
      auto existing = comms_.find(name);
      if (existing == comms_.end()) {
        return absl::InvalidArgumentError(absl::StrCat("communicator '", name,
                                                       "' is not built in (world, group/<g>): give its ranks"));
      }
      members = existing->second.ranks;
    }
    if (!std::is_sorted(members.begin(), members.end()) ||
        std::adjacent_find(members.begin(), members.end()) != members.end() || members.front() < 0 ||
        members.back() >= world_size_) {
      return absl::InvalidArgumentError(absl::StrCat("communicator '", name, "': ranks [", RankList(members),
                                                     "] must be ascending, distinct and in 0..", world_size_ - 1));
    }
  }
  return members;
}

absl::StatusOr<CommTable::Comm*> CommTable::Resolve(int rank, const std::string& name, const std::vector<int>& ranks) {
  if (static_cast<int>(name.size()) > limits_.max_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("communicator name of ", name.size(), " bytes is over max_name_bytes (",
                                                   limits_.max_name_bytes, ")"));
  }
  if (!comms_.count(name) && static_cast<int>(comms_.size()) >= limits_.max_communicators_per_job) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", job_id_, "' already has ", comms_.size(), " communicators (max_communicators_per_job); reuse "
        "names, or raise --max-communicators-per-job"));
  }
  auto resolved = Members(name, ranks);
  if (!resolved.ok()) return resolved.status();
  const std::vector<int>& members = *resolved;
  if (!ranks.empty() && ranks != members) {
    return absl::FailedPreconditionError(absl::StrCat("communicator '", name, "' has ranks [", RankList(members),
                                                      "] but rank ", rank, " asked for [", RankList(ranks), "]"));
  }
  if (!std::binary_search(members.begin(), members.end(), rank)) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " is not a member of communicator '", name,
                                                      "' (ranks ", RankList(members), ")"));
  }
  Comm& comm = comms_[name];
  if (comm.name.empty()) {
    comm.name = name;
    comm.ranks = members;
    for (int r : members) comm.member_state[r] = CommMemberState::kAbsent;
  } else if (comm.ranks != members) {
    return absl::FailedPreconditionError(absl::StrCat("communicator '", name, "' has ranks [", RankList(comm.ranks),
                                                      "] but rank ", rank, " asked for [", RankList(members), "]"));
  }
  return &comm;
}

absl::Status CommTable::CheckEpoch(const Comm& comm, int64_t epoch) const {
  if (epoch != comm.epoch) {
    return absl::FailedPreconditionError(absl::StrCat("wrong epoch ", epoch, " for communicator '", comm.name,
                                                      "': the current epoch is ", comm.epoch,
                                                      "; join again (CommJoin) to get it"));
  }
  if (comm.state == v1::COMM_STATE_ABORTED || comm.state == v1::COMM_STATE_ABORTING ||
      comm.state == v1::COMM_STATE_CLOSED) {
    return absl::AbortedError(absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch,
                                           " was aborted: ", comm.abort_reason));
  }
  return absl::OkStatus();
}

void CommTable::ForgetStore(Comm& comm) {
  comm.store.clear();
  comm.store_charge = BufferCharge();  // Its bytes go back to the daemon's budget.
}

void CommTable::MaybeStartEpoch(CommHost& host, Comm& comm) {
  // Joiners wait while live members still hold the aborted epoch's communicator.
  if (comm.state == v1::COMM_STATE_ABORTING) return;
  const bool needs_epoch =
      comm.epoch == 0 || comm.state == v1::COMM_STATE_ABORTED || comm.state == v1::COMM_STATE_CLOSED;
  if (needs_epoch) {
    for (int r : comm.ranks) {
      if (host.StateOf(r) != v1::RANK_STATE_LIVE) return;
    }
    comm.epoch++;
    comm.state = v1::COMM_STATE_FORMING;
    ForgetStore(comm);
    comm.lost_ranks.clear();
    comm.behind.clear();
    ClearProgress(comm.name);
    for (int r : comm.ranks) comm.member_state[r] = CommMemberState::kAbsent;
    host.Event(Severity::kInfo, EventKind::kCommForming, -1,
               absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, " ranks ", RankList(comm.ranks)));
  }
  auto waiters = std::move(comm.join_waiters);
  comm.join_waiters.clear();
  for (auto& w : waiters) {
    comm.member_state[w.rank] = CommMemberState::kJoined;
    Complete(host, w.done, absl::StatusOr<CommMembership>(CommMembership{comm.epoch, comm.ranks, comm.abort_reason}));
  }
}

void CommTable::Join(CommHost& host, const CoreMutex& /*held*/, const CommJoinCall& call, JoinDone done) {
  auto comm = Resolve(call.caller.rank, call.name, call.ranks);
  if (!comm.ok()) {
    Complete(host, done, absl::StatusOr<CommMembership>(comm.status()));
    return;
  }
  (*comm)->join_waiters.push_back({call.caller.rank, host.Now() + WaitFor(call.timeout), std::move(done)});
  MaybeStartEpoch(host, **comm);
}

absl::Status CommTable::Set(CommHost& host, const CoreMutex& /*held*/, StoreSetCall call) {
  auto comm = Resolve(call.caller.rank, call.name, {});
  if (!comm.ok()) return comm.status();
  Comm& c = **comm;
  if (absl::Status s = CheckEpoch(c, call.epoch); !s.ok()) return s;
  if (call.key.empty()) return absl::InvalidArgumentError("store key is empty");
  if (static_cast<int>(call.key.size()) > limits_.max_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store key of ", call.key.size(), " bytes is over max_name_bytes (",
                                                   limits_.max_name_bytes, ")"));
  }
  if (static_cast<int>(call.value.size()) > limits_.max_store_value_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store value of ", call.value.size(), " bytes for key '", Printable(call.key, 64),
        "' is over max_store_value_bytes (", limits_.max_store_value_bytes, ")"));
  }
  if (!c.store.count(call.key) && c.store.size() >= 2 * c.ranks.size() + 16) {
    return absl::ResourceExhaustedError(absl::StrCat("communicator '", c.name, "' epoch ", c.epoch, " already holds ",
                                                     c.store.size(), " keys (at most 2 x members + 16)"));
  }
  if (c.store.count(call.key)) {
    return absl::AlreadyExistsError(absl::StrCat("key '", Printable(call.key, 64), "' of communicator '", c.name,
                                                 "' epoch ", c.epoch,
                                                 " was already published; each key is set once per epoch"));
  }
  // Every byte a client makes the daemon hold is under max_buffered_bytes: 1024 communicators
  // of a job could otherwise hold 18 x 64 KiB each (1152 MiB), outside every bound.
  const int64_t cost = kStoreEntryOverhead + static_cast<int64_t>(call.key.size() + call.value.size());
  if (buffers_ != nullptr && !c.store_charge.Add(buffers_, cost)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store value of ", call.value.size(), " bytes for key '", Printable(call.key, 64), "' of communicator '",
        c.name, "' epoch ", c.epoch, " does not fit the daemon's buffers (max_buffered_bytes ", buffers_->limit(),
        ", ", buffers_->used(), " in use by all jobs): raise max_buffered_bytes, or open fewer communicators at once"));
  }
  c.store.emplace(call.key, std::move(call.value));
  auto waiters = std::move(c.get_waiters);
  c.get_waiters.clear();
  for (auto& w : waiters) {
    bool all = std::all_of(w.keys.begin(), w.keys.end(), [&](const std::string& k) { return c.store.count(k); });
    if (!all) {
      c.get_waiters.push_back(std::move(w));
      continue;
    }
    Complete(host, w.done, absl::StatusOr<std::vector<std::string>>(Values(c, w.keys)));
  }
  return absl::OkStatus();
}

std::vector<std::string> CommTable::Values(const Comm& comm, const std::vector<std::string>& keys) {
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const std::string& k : keys) {
    auto it = comm.store.find(k);
    // The callers checked every key first; a missing one answers empty rather than crash.
    if (!SHARDCOORD_INVARIANT(it != comm.store.end(), absl::StrCat("store key '", Printable(k, 64),
                                                                   "' answered before it was set"))) {
      values.emplace_back();
      continue;
    }
    values.push_back(it->second);
  }
  return values;
}

void CommTable::Get(CommHost& host, const CoreMutex& /*held*/, StoreGetCall call, GetDone done) {
  auto comm = Resolve(call.caller.rank, call.name, {});
  absl::Status s = comm.ok() ? CheckEpoch(**comm, call.epoch) : comm.status();
  if (!s.ok()) {
    Complete(host, done, absl::StatusOr<std::vector<std::string>>(s));
    return;
  }
  Comm& c = **comm;
  if (std::all_of(call.keys.begin(), call.keys.end(), [&](const std::string& k) { return c.store.count(k); })) {
    Complete(host, done, absl::StatusOr<std::vector<std::string>>(Values(c, call.keys)));
    return;
  }
  c.get_waiters.push_back({c.epoch, std::move(call.keys), host.Now() + WaitFor(call.timeout), std::move(done)});
}

absl::Status CommTable::Report(CommHost& host, const CoreMutex& /*held*/, const CommReportCall& call) {
  auto comm = Resolve(call.caller.rank, call.name, {});
  if (!comm.ok()) return comm.status();
  Comm& c = **comm;
  if (absl::Status s = CheckEpoch(c, call.epoch); !s.ok()) return s;
  if (call.kind == CommReportKind::kReady) {
    c.member_state[call.caller.rank] = CommMemberState::kReady;
    const bool all = std::all_of(c.ranks.begin(), c.ranks.end(),
                                 [&](int r) { return c.member_state[r] == CommMemberState::kReady; });
    if (all && c.state == v1::COMM_STATE_FORMING) {
      c.state = v1::COMM_STATE_READY;
      host.Event(Severity::kInfo, EventKind::kCommReady, -1,
                 absl::StrCat("communicator '", c.name, "' epoch ", c.epoch, " ready on ranks ", RankList(c.ranks)));
    }
    return absl::OkStatus();
  }
  if (call.kind == CommReportKind::kError) {
    Abort(host, c, absl::StrCat("rank ", call.caller.rank, " reported a communicator error: ", call.error), {});
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "CommReport: kind must be KIND_READY or KIND_ERROR, got ", static_cast<int>(call.kind),
      " (aborts are acknowledged on the session stream with CommAborted)"));
}

void CommTable::Abort(CommHost& host, Comm& comm, const std::string& reason, const std::vector<int>& lost,
                      bool failure) {
  if (comm.epoch == 0 || comm.state == v1::COMM_STATE_ABORTED || comm.state == v1::COMM_STATE_ABORTING ||
      comm.state == v1::COMM_STATE_CLOSED) {
    return;
  }
  comm.state = v1::COMM_STATE_ABORTING;
  comm.ended_cleanly = !failure;
  comm.abort_reason = reason;
  comm.lost_ranks = lost;
  if (failure) comm.epochs_aborted++;
  const absl::Status why = absl::AbortedError(
      absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, " was aborted: ", reason));
  auto waiters = std::move(comm.get_waiters);
  comm.get_waiters.clear();
  for (auto& w : waiters) Complete(host, w.done, absl::StatusOr<std::vector<std::string>>(why));
  v1::CoordinatorMessage msg;
  auto* a = msg.mutable_comm_abort();
  a->set_name(comm.name);
  a->set_epoch(comm.epoch);
  a->set_reason(reason);
  for (int r : lost) a->add_lost_ranks(r);
  for (int r : comm.ranks) {
    if (std::find(lost.begin(), lost.end(), r) == lost.end()) host.Send(r, msg);
  }
  host.Event(failure ? Severity::kError : Severity::kInfo, failure ? EventKind::kCommAborted : EventKind::kCommClosed,
             lost.empty() ? -1 : lost.front(),
             absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, failure ? " aborted: " : " closed: ",
                          reason));
  MaybeFinishAbort(host, comm);
}

void CommTable::AckAbort(CommHost& host, const CoreMutex& /*held*/, const CommAbortAck& ack, int rank) {
  auto it = comms_.find(ack.name);
  if (it == comms_.end()) return;
  Comm& comm = it->second;
  if (ack.epoch != comm.epoch || comm.state != v1::COMM_STATE_ABORTING) return;
  if (!std::binary_search(comm.ranks.begin(), comm.ranks.end(), rank)) return;
  comm.member_state[rank] = CommMemberState::kAborted;
  MaybeFinishAbort(host, comm);
}

void CommTable::MaybeFinishAbort(CommHost& host, Comm& comm) {
  if (comm.state != v1::COMM_STATE_ABORTING) return;
  for (int r : comm.ranks) {
    const CommMemberState st = comm.member_state[r];
    // Members that are gone need not acknowledge; a replacement has no old communicator.
    const bool gone =
        host.StateOf(r) != v1::RANK_STATE_LIVE || st == CommMemberState::kDead || st == CommMemberState::kLeft;
    if (!gone && st != CommMemberState::kAborted && st != CommMemberState::kAbsent) return;
  }
  comm.state = comm.ended_cleanly ? v1::COMM_STATE_CLOSED : v1::COMM_STATE_ABORTED;
  ForgetStore(comm);
  MaybeStartEpoch(host, comm);
}

void CommTable::OnRankLost(CommHost& host, const CoreMutex& /*held*/, int rank, bool clean, const std::string& reason) {
  for (auto& [name, comm] : comms_) {
    if (!std::binary_search(comm.ranks.begin(), comm.ranks.end(), rank)) continue;
    comm.member_state[rank] = clean ? CommMemberState::kLeft : CommMemberState::kDead;
    if (!clean) {
      Abort(host, comm, reason, {rank});
    } else if (comm.epoch > 0 && (comm.state == v1::COMM_STATE_FORMING || comm.state == v1::COMM_STATE_READY)) {
      // A clean leave aborts nobody: the others may still be finishing the last collective
      // with it. Once every member is gone the epoch is closed.
      const bool all_gone = std::all_of(comm.ranks.begin(), comm.ranks.end(),
                                        [&](int r) { return host.StateOf(r) != v1::RANK_STATE_LIVE; });
      if (all_gone) {
        comm.state = v1::COMM_STATE_CLOSED;
        ForgetStore(comm);
        comm.abort_reason = absl::StrCat("every member left (last: rank ", rank, ")");
        host.Event(Severity::kInfo, EventKind::kCommClosed, rank,
                   absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, " closed: ", comm.abort_reason));
      }
    }
    MaybeFinishAbort(host, comm);  // Already aborting: this member no longer owes an ack.
  }
}

void CommTable::OnRankBack(CommHost& host, const CoreMutex& /*held*/, int rank) {
  for (auto& [name, comm] : comms_) {
    const bool member = std::binary_search(comm.ranks.begin(), comm.ranks.end(), rank);
    if (member && comm.member_state[rank] == CommMemberState::kLeft &&
        (comm.state == v1::COMM_STATE_FORMING || comm.state == v1::COMM_STATE_READY)) {
      // A member that left comes back: the others' epoch cannot take it in; end it cleanly
      // so that everyone joins the next one.
      Abort(host, comm, absl::StrCat("rank ", rank, " left and registered again"), {}, /*failure=*/false);
    }
    if (!comm.join_waiters.empty()) MaybeStartEpoch(host, comm);
  }
}

std::string CommTable::MissingRanks(const CommHost& host, const std::vector<int>& missing) {
  // Dead first, with the first one's reason: ranks that left after it usually left because
  // of it, and an operator must see the cause, not the last casualty.
  std::vector<int> dead, left, never;
  for (int r : missing) {
    const v1::RankState st = host.StateOf(r);
    (st == v1::RANK_STATE_DEAD ? dead : st == v1::RANK_STATE_LEFT ? left : never).push_back(r);
  }
  std::vector<std::string> parts;
  if (!dead.empty()) {
    parts.push_back(absl::StrCat(dead.size() == 1 ? "rank " : "ranks ", RankList(dead), " dead (rank ", dead[0], ": ",
                                 host.DeadReasonOf(dead[0]), ")"));
  }
  if (!left.empty()) parts.push_back(absl::StrCat(left.size() == 1 ? "rank " : "ranks ", RankList(left), " left"));
  if (!never.empty()) {
    parts.push_back(absl::StrCat(never.size() == 1 ? "rank " : "ranks ", RankList(never), " not registered"));
  }
  return absl::StrCat("not every member is live: ", absl::StrJoin(parts, "; "));
}

void CommTable::Tick(CommHost& host, const CoreMutex& /*held*/, absl::Time now) {
  for (auto& [name, comm] : comms_) {
    ExpireWaiters(host, comm, now);
    DetectBehind(host, comm, now);
  }
}

void CommTable::ExpireWaiters(CommHost& host, Comm& comm, absl::Time now) {
  std::vector<JoinWaiter> keep_join;
  for (auto& w : comm.join_waiters) {
    if (w.deadline > now) {
      keep_join.push_back(std::move(w));
      continue;
    }
    std::vector<int> missing, unacked;
    for (int r : comm.ranks) {
      if (host.StateOf(r) != v1::RANK_STATE_LIVE) {
        missing.push_back(r);
      } else if (comm.state == v1::COMM_STATE_ABORTING && comm.member_state[r] != CommMemberState::kAborted) {
        unacked.push_back(r);
      }
    }
    std::string why = !missing.empty()
                          ? MissingRanks(host, missing)
                          : absl::StrCat("ranks ", RankList(unacked), " have not aborted epoch ", comm.epoch, " yet");
    Complete(host, w.done, absl::StatusOr<CommMembership>(absl::DeadlineExceededError(absl::StrCat(
        "communicator '", comm.name, "' cannot start epoch ", comm.epoch + 1, ": ", why,
        comm.abort_reason.empty() ? "" : absl::StrCat(" (last epoch aborted: ", comm.abort_reason, ")")))));
  }
  comm.join_waiters = std::move(keep_join);
  std::vector<GetWaiter> keep_get;
  for (auto& w : comm.get_waiters) {
    if (w.deadline > now) {
      keep_get.push_back(std::move(w));
      continue;
    }
    std::vector<std::string> missing;
    for (const auto& k : w.keys) {
      if (!comm.store.count(k)) missing.push_back(k);
    }
    Complete(host, w.done, absl::StatusOr<std::vector<std::string>>(absl::DeadlineExceededError(
        absl::StrCat("communicator '", comm.name, "' epoch ", w.epoch, ": keys [", absl::StrJoin(missing, ", "),
                     "] were not published in time"))));
  }
  comm.get_waiters = std::move(keep_get);
}

void CommTable::FailAllWaiters(CommHost& host, const CoreMutex& /*held*/, const absl::Status& why) {
  for (auto& [name, comm] : comms_) {
    for (auto& w : comm.join_waiters) Complete(host, w.done, absl::StatusOr<CommMembership>(why));
    for (auto& w : comm.get_waiters) Complete(host, w.done, absl::StatusOr<std::vector<std::string>>(why));
    comm.join_waiters.clear();
    comm.get_waiters.clear();
  }
}

void CommTable::ClearProgress(const std::string& name) {
  absl::MutexLock lock(&progress_mu_);
  progress_.erase(name);
}

void CommTable::RecordProgress(int rank, const std::vector<CommProgressReport>& progress, absl::Time now) {
  absl::MutexLock lock(&progress_mu_);
  for (const CommProgressReport& p : progress) {
    // comms_ changes only under the core's exclusive lock: reading it here is safe.
    auto it = comms_.find(p.name);
    if (it == comms_.end() || it->second.epoch != p.epoch) continue;
    if (!std::binary_search(it->second.ranks.begin(), it->second.ranks.end(), rank)) continue;
    auto& [epoch, by_rank] = progress_[p.name];
    if (epoch != p.epoch) {
      epoch = p.epoch;
      by_rank.clear();
    }
    Progress& pr = by_rank[rank];
    const bool moved = pr.issued != p.issued || pr.completed != p.completed;
    pr.issued = p.issued;
    pr.completed = p.completed;
    if (pr.completed >= pr.issued) {
      pr.waiting_since = absl::InfinitePast();
    } else if (moved || pr.waiting_since == absl::InfinitePast()) {
      pr.waiting_since = now;
    }
  }
}

void CommTable::DetectBehind(CommHost& host, Comm& comm, absl::Time now) {
  std::string behind;
  if (comm.state == v1::COMM_STATE_READY || comm.state == v1::COMM_STATE_FORMING) {
    absl::MutexLock lock(&progress_mu_);
    auto found = progress_.find(comm.name);
    const std::map<int, Progress> none;
    const std::map<int, Progress>& progress =
        found != progress_.end() && found->second.first == comm.epoch ? found->second.second : none;
    // Members blocked in a collective for longer than the threshold, by collective.
    std::map<int64_t, std::vector<int>> waiting;  // collective number -> ranks
    absl::Duration longest;
    for (const auto& [r, pr] : progress) {
      if (pr.completed < pr.issued && now - pr.waiting_since > behind_threshold_) {
        waiting[pr.issued].push_back(r);
        longest = std::max(longest, now - pr.waiting_since);
      }
    }
    if (!waiting.empty()) {
      const int64_t at = waiting.rbegin()->first;
      std::vector<std::string> laggards;
      for (int r : comm.ranks) {
        auto it = progress.find(r);
        const int64_t issued = it == progress.end() ? 0 : it->second.issued;
        if (issued < at) laggards.push_back(absl::StrCat("rank ", r, " at collective ", issued));
      }
      if (!laggards.empty()) {
        behind = absl::StrCat(comm.name, " epoch ", comm.epoch, ": ", absl::StrJoin(laggards, ", "), ", ranks ",
                              RankList(waiting.rbegin()->second), " waiting at ", at, " for ",
                              absl::ToInt64Seconds(longest), " s");
      }
    }
  }
  if (behind != comm.behind) {
    if (!behind.empty()) host.Event(Severity::kWarning, EventKind::kCommRankBehind, -1, behind);
    comm.behind = behind;
  }
}

void CommTable::Resume(CommHost& host, const CoreMutex& /*held*/, int rank, const v1::ResumeState& state) {
  for (const auto& ce : state.comms()) {
    auto members = Members(ce.name(), std::vector<int>(ce.ranks().begin(), ce.ranks().end()));
    if (!members.ok() || !std::binary_search(members->begin(), members->end(), rank)) continue;
    Comm& comm = comms_[ce.name()];
    if (comm.name.empty()) {
      comm.name = ce.name();
      comm.ranks = *members;
      for (int r : *members) comm.member_state[r] = CommMemberState::kAbsent;
      comm.recovering = true;
    }
    if (!comm.recovering || comm.ranks != *members) continue;
    comm.resumed_epochs[rank] = ce.epoch();
    comm.epoch = std::max(comm.epoch, ce.epoch());
    MaybeFinishRecovery(host, comm);
  }
}

void CommTable::MaybeFinishRecovery(CommHost& host, Comm& comm) {
  for (int r : comm.ranks) {
    if (!comm.resumed_epochs.count(r)) return;  // Not back yet (the window fails it).
  }
  comm.recovering = false;
  const bool same = std::all_of(comm.ranks.begin(), comm.ranks.end(),
                                [&](int r) { return comm.resumed_epochs[r] == comm.epoch; });
  comm.resumed_epochs.clear();
  comm.state = v1::COMM_STATE_READY;
  for (int r : comm.ranks) comm.member_state[r] = CommMemberState::kReady;
  if (same) {
    host.Event(Severity::kInfo, EventKind::kCommRecovered, -1,
               absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, " kept: every member is back"));
    return;
  }
  Abort(host, comm, "its members held different epochs when they resumed after the coordinator restart", {});
}

void CommTable::Fill(v1::ListCommsResponse* out) const {
  absl::MutexLock lock(&progress_mu_);
  for (const auto& [name, comm] : comms_) {
    auto* c = out->add_comms();
    c->set_job_id(job_id_);
    c->set_name(name);
    c->set_epoch(comm.epoch);
    for (int r : comm.ranks) c->add_ranks(r);
    c->set_state(comm.state);
    auto found = progress_.find(name);
    const bool current = found != progress_.end() && found->second.first == comm.epoch;
    for (const auto& [r, st] : comm.member_state) {
      auto* m = c->add_members();
      m->set_rank(r);
      m->set_state(CommMemberStateName(st));
      if (!current) continue;
      auto p = found->second.second.find(r);
      if (p != found->second.second.end()) {
        m->set_issued(p->second.issued);
        m->set_completed(p->second.completed);
      }
    }
    c->set_behind(comm.behind);
    c->set_abort_reason(comm.abort_reason);
    for (int r : comm.lost_ranks) c->add_lost_ranks(r);
    c->set_epochs_aborted(comm.epochs_aborted);
  }
}

std::vector<std::string> CommTable::Alerts(const std::function<bool(int rank)>& left) const {
  std::vector<std::string> alerts;
  for (const auto& [name, comm] : comms_) {
    if (!comm.behind.empty()) alerts.push_back(absl::StrCat("behind: ", comm.behind));
    if ((comm.state == v1::COMM_STATE_ABORTING || comm.state == v1::COMM_STATE_ABORTED) && comm.epochs_aborted > 0 &&
        !comm.lost_ranks.empty() && !left(comm.lost_ranks.front())) {
      alerts.push_back(absl::StrCat(name, " epoch ", comm.epoch, " ",
                                    comm.state == v1::COMM_STATE_ABORTING ? "aborting" : "aborted", ": ",
                                    comm.abort_reason));
    }
  }
  return alerts;
}

}  // namespace shardcoord::coordinator
