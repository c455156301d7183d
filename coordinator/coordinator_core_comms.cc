// CoordinatorCore, part 4: communicators (DESIGN 4). The coordinator is the rendezvous of
// every (job, communicator, epoch) and the authority on its health: it aborts an epoch
// for every member when one member is lost, and starts the next epoch once every member
// is live again.
#include <algorithm>

#include "absl/strings/numbers.h"
#include "coordinator/secrets.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/text.h"

namespace shardcoord::coordinator {
namespace {

constexpr absl::Duration kDefaultCommWait = absl::Seconds(60);
constexpr absl::Duration kMaxCommWait = absl::Minutes(30);

absl::Duration WaitFor(int32_t timeout_ms) {
  if (timeout_ms <= 0) return kDefaultCommWait;
  return std::min(absl::Milliseconds(timeout_ms), kMaxCommWait);
}

}  // namespace

absl::StatusOr<std::vector<int>> CoordinatorCore::CommMembers(const Job& job, const std::string& name,
                                                             const std::vector<int>& ranks) {
  const std::string& job_id = job.id;
  if (name.empty()) return absl::InvalidArgumentError("communicator name is empty");
  if (std::string bad = ControlCharacterIn(name); !bad.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("communicator name '", Printable(name, 64), "' has a control character (",
                                                   bad, "); names must be printable"));
  }
  std::vector<int> members;
  if (name == "world") {
    for (int r = 0; r < job.world_size; ++r) members.push_back(r);
  } else if (name.rfind("group/", 0) == 0) {
    int g = -1;
    if (!absl::SimpleAtoi(name.substr(6), &g) || g < 0 || g >= static_cast<int>(job.groups.size())) {
      return absl::InvalidArgumentError(absl::StrCat("communicator '", name, "': job '", job_id, "' has groups 0..",
                                                     job.groups.size() - 1));
    }
    members = job.groups[g].ranks;
  } else {
    members = ranks;
    if (members.empty()) {
      auto existing = job.comms.find(name);
      if (existing == job.comms.end()) {
        return absl::InvalidArgumentError(absl::StrCat("communicator '", name,
                                                       "' is not built in (world, group/<g>): give its ranks"));
      }
      members = existing->second.ranks;
    }
    if (!std::is_sorted(members.begin(), members.end()) ||
        std::adjacent_find(members.begin(), members.end()) != members.end() || members.front() < 0 ||
        members.back() >= job.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("communicator '", name, "': ranks [", RankList(members),
                                                     "] must be ascending, distinct and in 0..",
                                                     job.world_size - 1));
    }
  }
  return members;
}

absl::StatusOr<CoordinatorCore::Comm*> CoordinatorCore::ResolveComm(const std::string& job_id, int rank,
                                                                    const std::string& session_key,
                                                                    const std::string& name,
                                                                    const std::vector<int>& ranks,
                                                                    Job** job_out) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("no job '", job_id, "': register the rank first"));
  }
  Job& job = *it->second;
  if (rank < 0 || rank >= job.world_size || job.members[rank].state != v1::RANK_STATE_LIVE) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of job '", job_id, "' is not a live registered rank; register it before "
        "using communicators"));
  }
  if (!SameSecret(session_key, job.members[rank].session_key)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", rank, " of job '", Printable(job_id, 64), "': this call does not come from the rank's live session "
        "(session_key missing or wrong); communicator calls are accepted only from the worker that registered the rank"));
  }
  if (static_cast<int>(name.size()) > options_.limits.max_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("communicator name of ", name.size(), " bytes is over max_name_bytes (",
                                                   options_.limits.max_name_bytes, ")"));
  }
  if (!job.comms.count(name) && static_cast<int>(job.comms.size()) >= options_.limits.max_communicators_per_job) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", job_id, "' already has ", job.comms.size(), " communicators (max_communicators_per_job); reuse "
        "names, or raise --max-communicators-per-job"));
  }
  auto resolved = CommMembers(job, name, ranks);
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
  Comm& comm = job.comms[name];
  if (comm.name.empty()) {
    comm.name = name;
    comm.ranks = members;
    for (int r : members) comm.member_state[r] = CommMemberState::kAbsent;
  } else if (comm.ranks != members) {
    return absl::FailedPreconditionError(absl::StrCat("communicator '", name, "' has ranks [", RankList(comm.ranks),
                                                      "] but rank ", rank, " asked for [", RankList(members), "]"));
  }
  *job_out = &job;
  return &comm;
}

absl::Status CoordinatorCore::CheckEpoch(const Comm& comm, int64_t epoch) const {
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

void CoordinatorCore::MaybeStartEpoch(Job& job, Comm& comm) {
  // Joiners wait while live members still hold the aborted epoch's communicator.
  if (comm.state == v1::COMM_STATE_ABORTING) return;
  const bool needs_epoch =
      comm.epoch == 0 || comm.state == v1::COMM_STATE_ABORTED || comm.state == v1::COMM_STATE_CLOSED;
  if (needs_epoch) {
    for (int r : comm.ranks) {
      if (job.members[r].state != v1::RANK_STATE_LIVE) return;
    }
    comm.epoch++;
    comm.state = v1::COMM_STATE_FORMING;
    comm.store.clear();
    comm.lost_ranks.clear();
    comm.progress.clear();
    comm.behind.clear();
    for (int r : comm.ranks) comm.member_state[r] = CommMemberState::kAbsent;
    Event("info", EventKind::kCommForming, job.id, -1, -1,
          absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, " ranks ", RankList(comm.ranks)));
  }
  auto waiters = std::move(comm.join_waiters);
  comm.join_waiters.clear();
  for (auto& w : waiters) {
    v1::CommJoinResponse resp;
    resp.set_epoch(comm.epoch);
    for (int r : comm.ranks) resp.add_ranks(r);
    resp.set_previous_abort_reason(comm.abort_reason);
    comm.member_state[w.rank] = CommMemberState::kJoined;
    Complete(w.done, resp);
  }
}

void CoordinatorCore::CommJoin(const v1::CommJoinRequest& req, JoinDone done) {
  Locked lock(this);
  if (shut_down_) {
    Complete(done, absl::UnavailableError("coordinator is shutting down"));
    return;
  }
  Job* job = nullptr;
  auto comm = ResolveComm(req.job_id(), req.rank(), req.session_key(), req.name(),
                          std::vector<int>(req.ranks().begin(), req.ranks().end()), &job);
  if (!comm.ok()) {
    Complete(done, comm.status());
    return;
  }
  (*comm)->join_waiters.push_back({req.rank(), clock_->Now() + WaitFor(req.timeout_ms()), std::move(done)});
  MaybeStartEpoch(*job, **comm);
}

absl::Status CoordinatorCore::StoreSet(const v1::StoreSetRequest& req) {
  Locked lock(this);
  Job* job = nullptr;
  auto comm = ResolveComm(req.job_id(), req.rank(), req.session_key(), req.name(), {}, &job);
  if (!comm.ok()) return comm.status();
  Comm& c = **comm;
  if (absl::Status s = CheckEpoch(c, req.epoch()); !s.ok()) return s;
  if (req.key().empty()) return absl::InvalidArgumentError("store key is empty");
  if (static_cast<int>(req.key().size()) > options_.limits.max_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store key of ", req.key().size(), " bytes is over max_name_bytes (",
                                                   options_.limits.max_name_bytes, ")"));
  }
  if (static_cast<int>(req.value().size()) > options_.limits.max_store_value_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store value of ", req.value().size(), " bytes for key '", Printable(req.key(), 64),
        "' is over max_store_value_bytes (", options_.limits.max_store_value_bytes, ")"));
  }
  if (!c.store.count(req.key()) && c.store.size() >= 2 * c.ranks.size() + 16) {
    return absl::ResourceExhaustedError(absl::StrCat("communicator '", c.name, "' epoch ", c.epoch, " already holds ",
                                                     c.store.size(), " keys (at most 2 x members + 16)"));
  }
  auto [it, inserted] = c.store.try_emplace(req.key(), req.value());
  if (!inserted) {
    return absl::AlreadyExistsError(absl::StrCat("key '", Printable(req.key(), 64), "' of communicator '", c.name, "' epoch ",
                                                 c.epoch, " was already published; each key is set once per epoch"));
  }
  auto waiters = std::move(c.get_waiters);
  c.get_waiters.clear();
  for (auto& w : waiters) {
    bool all = std::all_of(w.keys.begin(), w.keys.end(), [&](const std::string& k) { return c.store.count(k); });
    if (!all) {
      c.get_waiters.push_back(std::move(w));
      continue;
    }
    v1::StoreGetResponse resp;
    for (const auto& k : w.keys) resp.add_values(c.store[k]);
    Complete(w.done, resp);
  }
  return absl::OkStatus();
}

void CoordinatorCore::StoreGet(const v1::StoreGetRequest& req, GetDone done) {
  Locked lock(this);
  if (shut_down_) {  // No ticker will expire a waiter any more.
    Complete(done, absl::UnavailableError("coordinator is shutting down"));
    return;
  }
  Job* job = nullptr;
  auto comm = ResolveComm(req.job_id(), req.rank(), req.session_key(), req.name(), {}, &job);
  if (!comm.ok()) {
    Complete(done, comm.status());
    return;
  }
  Comm& c = **comm;
  if (absl::Status s = CheckEpoch(c, req.epoch()); !s.ok()) {
    Complete(done, s);
    return;
  }
  std::vector<std::string> keys(req.keys().begin(), req.keys().end());
  if (std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return c.store.count(k); })) {
    v1::StoreGetResponse resp;
    for (const auto& k : keys) resp.add_values(c.store[k]);
    Complete(done, resp);
    return;
  }
  c.get_waiters.push_back({c.epoch, std::move(keys), clock_->Now() + WaitFor(req.timeout_ms()), std::move(done)});
}

absl::Status CoordinatorCore::CommReport(const v1::CommReportRequest& req) {
  Locked lock(this);
  Job* job = nullptr;
  auto comm = ResolveComm(req.job_id(), req.rank(), req.session_key(), req.name(), {}, &job);
  if (!comm.ok()) return comm.status();
  Comm& c = **comm;
  if (absl::Status s = CheckEpoch(c, req.epoch()); !s.ok()) return s;
  if (req.kind() == v1::CommReportRequest::KIND_READY) {
    c.member_state[req.rank()] = CommMemberState::kReady;
    const bool all = std::all_of(c.ranks.begin(), c.ranks.end(),
                                 [&](int r) { return c.member_state[r] == CommMemberState::kReady; });
    if (all && c.state == v1::COMM_STATE_FORMING) {
      c.state = v1::COMM_STATE_READY;
      Event("info", EventKind::kCommReady, job->id, -1, -1,
            absl::StrCat("communicator '", c.name, "' epoch ", c.epoch, " ready on ranks ", RankList(c.ranks)));
    }
    return absl::OkStatus();
  }
  if (req.kind() == v1::CommReportRequest::KIND_ERROR) {
    AbortComm(*job, c, absl::StrCat("rank ", req.rank(), " reported a communicator error: ", req.error()), {});
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "CommReport: kind must be KIND_READY or KIND_ERROR, got ", static_cast<int>(req.kind()),
      " (aborts are acknowledged on the session stream with CommAborted)"));
}

void CoordinatorCore::AbortComm(Job& job, Comm& comm, const std::string& reason, const std::vector<int>& lost,
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
  for (auto& w : waiters) Complete(w.done, why);
  v1::CoordinatorMessage msg;
  auto* a = msg.mutable_comm_abort();
  a->set_name(comm.name);
  a->set_epoch(comm.epoch);
  a->set_reason(reason);
  for (int r : lost) a->add_lost_ranks(r);
  for (int r : comm.ranks) {
    if (std::find(lost.begin(), lost.end(), r) == lost.end()) SendTo(job.members[r], msg);
  }
  Event(failure ? "error" : "info", failure ? EventKind::kCommAborted : EventKind::kCommClosed, job.id,
        lost.empty() ? -1 : lost.front(), -1,
        absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, failure ? " aborted: " : " closed: ", reason));
  MaybeFinishAbort(job, comm);
}

void CoordinatorCore::AckAbort(Job& job, Comm& comm, int rank, int64_t epoch) {
  if (epoch != comm.epoch || comm.state != v1::COMM_STATE_ABORTING) return;
  comm.member_state[rank] = CommMemberState::kAborted;
  MaybeFinishAbort(job, comm);
}

void CoordinatorCore::MaybeFinishAbort(Job& job, Comm& comm) {
  if (comm.state != v1::COMM_STATE_ABORTING) return;
  for (int r : comm.ranks) {
    const CommMemberState st = comm.member_state[r];
    // Members that are gone need not acknowledge; a replacement has no old communicator.
    const bool gone = job.members[r].state != v1::RANK_STATE_LIVE || st == CommMemberState::kDead ||
                      st == CommMemberState::kLeft;
    if (!gone && st != CommMemberState::kAborted && st != CommMemberState::kAbsent) return;
  }
  comm.state = comm.ended_cleanly ? v1::COMM_STATE_CLOSED : v1::COMM_STATE_ABORTED;
  MaybeStartEpoch(job, comm);
}

void CoordinatorCore::OnMemberLost(Job& job, int rank, bool clean, const std::string& reason) {
  for (auto& [name, comm] : job.comms) {
    if (!std::binary_search(comm.ranks.begin(), comm.ranks.end(), rank)) continue;
    comm.member_state[rank] = clean ? CommMemberState::kLeft : CommMemberState::kDead;
    if (!clean) {
      AbortComm(job, comm, reason, {rank});
    } else if (comm.epoch > 0 && (comm.state == v1::COMM_STATE_FORMING || comm.state == v1::COMM_STATE_READY)) {
      // A clean leave aborts nobody: the others may still be finishing the last collective
      // with it. Once every member is gone the epoch is closed.
      const bool all_gone = std::all_of(comm.ranks.begin(), comm.ranks.end(), [&](int r) {
        return job.members[r].state != v1::RANK_STATE_LIVE;
      });
      if (all_gone) {
        comm.state = v1::COMM_STATE_CLOSED;
        comm.abort_reason = absl::StrCat("every member left (last: rank ", rank, ")");
        Event("info", EventKind::kCommClosed, job.id, rank, -1,
              absl::StrCat("communicator '", comm.name, "' epoch ", comm.epoch, " closed: ", comm.abort_reason));
      }
    }
    MaybeFinishAbort(job, comm);  // Already aborting: this member no longer owes an ack.
  }
}

void CoordinatorCore::OnCommAborted(uint64_t session_id, const v1::CommAborted& ack) {
  Locked lock(this);
  Job* job = nullptr;
  Member* m = LiveMember(session_id, &job);
  if (m == nullptr) return;
  TakeCommAborted(*job, *m, ack);
}

void CoordinatorCore::TakeCommAborted(Job& job, Member& m, const v1::CommAborted& ack) {
  m.last_seen = clock_->Now();
  auto it = job.comms.find(ack.name());
  if (it != job.comms.end()) AckAbort(job, it->second, m.rank, ack.epoch());
}

void CoordinatorCore::OnMemberBack(Job& job, int rank) {
  for (auto& [name, comm] : job.comms) {
    const bool member = std::binary_search(comm.ranks.begin(), comm.ranks.end(), rank);
    if (member && comm.member_state[rank] == CommMemberState::kLeft &&
        (comm.state == v1::COMM_STATE_FORMING || comm.state == v1::COMM_STATE_READY)) {
      // A member that left comes back: the others' epoch cannot take it in; end it cleanly
      // so that everyone joins the next one.
      AbortComm(job, comm, absl::StrCat("rank ", rank, " left and registered again"), {}, /*failure=*/false);
    }
    if (!comm.join_waiters.empty()) MaybeStartEpoch(job, comm);
  }
}

std::string CoordinatorCore::MissingRanks(const Job& job, const std::vector<int>& missing) {
  // Dead first, with the first one's reason: ranks that left after it usually left because
  // of it, and an operator must see the cause, not the last casualty.
  std::vector<int> dead, left, never;
  for (int r : missing) {
    const v1::RankState st = job.members[r].state;
    (st == v1::RANK_STATE_DEAD ? dead : st == v1::RANK_STATE_LEFT ? left : never).push_back(r);
  }
  std::vector<std::string> parts;
  if (!dead.empty()) {
    parts.push_back(absl::StrCat(dead.size() == 1 ? "rank " : "ranks ", RankList(dead), " dead (rank ", dead[0], ": ",
                                 job.members[dead[0]].dead_reason, ")"));
  }
  if (!left.empty()) parts.push_back(absl::StrCat(left.size() == 1 ? "rank " : "ranks ", RankList(left), " left"));
  if (!never.empty()) {
    parts.push_back(absl::StrCat(never.size() == 1 ? "rank " : "ranks ", RankList(never), " not registered"));
  }
  return absl::StrCat("not every member is live: ", absl::StrJoin(parts, "; "));
}

void CoordinatorCore::ExpireCommWaiters(Job& job, absl::Time now) {
  for (auto& [name, comm] : job.comms) {
    std::vector<Comm::JoinWaiter> keep_join;
    for (auto& w : comm.join_waiters) {
      if (w.deadline > now) {
        keep_join.push_back(std::move(w));
        continue;
      }
      std::vector<int> missing, unacked;
      for (int r : comm.ranks) {
        if (job.members[r].state != v1::RANK_STATE_LIVE) {
          missing.push_back(r);
        } else if (comm.state == v1::COMM_STATE_ABORTING && comm.member_state[r] != CommMemberState::kAborted) {
          unacked.push_back(r);
        }
      }
      std::string why = !missing.empty()
                            ? MissingRanks(job, missing)
                            : absl::StrCat("ranks ", RankList(unacked), " have not aborted epoch ", comm.epoch, " yet");
      Complete(w.done, absl::DeadlineExceededError(absl::StrCat(
          "communicator '", comm.name, "' cannot start epoch ", comm.epoch + 1, ": ", why,
          comm.abort_reason.empty() ? "" : absl::StrCat(" (last epoch aborted: ", comm.abort_reason, ")"))));
    }
    comm.join_waiters = std::move(keep_join);
    std::vector<Comm::GetWaiter> keep_get;
    for (auto& w : comm.get_waiters) {
      if (w.deadline > now) {
        keep_get.push_back(std::move(w));
        continue;
      }
      std::vector<std::string> missing;
      for (const auto& k : w.keys) {
        if (!comm.store.count(k)) missing.push_back(k);
      }
      Complete(w.done, absl::DeadlineExceededError(absl::StrCat("communicator '", comm.name, "' epoch ", w.epoch,
                                                      ": keys [", absl::StrJoin(missing, ", "),
                                                      "] were not published in time")));
    }
    comm.get_waiters = std::move(keep_get);
  }
}

void CoordinatorCore::FailAllCommWaiters(const absl::Status& why) {
  for (auto& [id, job] : jobs_) {
    for (auto& [name, comm] : job->comms) {
      for (auto& w : comm.join_waiters) Complete(w.done, why);
      for (auto& w : comm.get_waiters) Complete(w.done, why);
      comm.join_waiters.clear();
      comm.get_waiters.clear();
    }
  }
}

void CoordinatorCore::RecordProgress(Job& job, int rank, const v1::Heartbeat& hb, absl::Time now) {
  for (const auto& p : hb.comms()) {
    auto it = job.comms.find(p.name());
    if (it == job.comms.end() || it->second.epoch != p.epoch()) continue;
    Comm::Progress& pr = it->second.progress[rank];
    const bool moved = pr.issued != p.issued() || pr.completed != p.completed();
    pr.issued = p.issued();
    pr.completed = p.completed();
    if (pr.completed >= pr.issued) {
      pr.waiting_since = absl::InfinitePast();
    } else if (moved || pr.waiting_since == absl::InfinitePast()) {
      pr.waiting_since = now;
    }
  }
}

void CoordinatorCore::DetectBehind(Job& job, absl::Time now) {
  for (auto& [name, comm] : job.comms) {
    std::string behind;
    if (comm.state == v1::COMM_STATE_READY || comm.state == v1::COMM_STATE_FORMING) {
      // Members blocked in a collective for longer than the threshold, by collective.
      std::map<int64_t, std::vector<int>> waiting;  // collective number -> ranks
      absl::Duration longest;
      for (const auto& [r, pr] : comm.progress) {
        if (pr.completed < pr.issued && now - pr.waiting_since > options_.behind_threshold) {
          waiting[pr.issued].push_back(r);
          longest = std::max(longest, now - pr.waiting_since);
        }
      }
      if (!waiting.empty()) {
        const int64_t at = waiting.rbegin()->first;
        std::vector<std::string> laggards;
        for (int r : comm.ranks) {
          auto it = comm.progress.find(r);
          const int64_t issued = it == comm.progress.end() ? 0 : it->second.issued;
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
      if (!behind.empty()) Event("warning", EventKind::kCommRankBehind, job.id, -1, -1, behind);
      comm.behind = behind;
    }
  }
}

}  // namespace shardcoord::coordinator
