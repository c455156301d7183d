// Worker::Impl, the session stream: the reader thread applies what the coordinator sends
// (decisions, rejections, failures, communicator aborts, notices); the writer thread sends
// plans, heartbeats and the goodbye. See worker_impl.h.
#include "worker_impl.h"

#include <algorithm>

#include "shardcoord/plan_check.h"

namespace shardcoord {

void Worker::Impl::ReaderLoop() {
  while (true) {
    ReadStream();
    const grpc::Status st = FinishStream();
    absl::MutexLock lock(&mu_);
    if (!registered_) {
      // Registration refused: the coordinator's status says why.
      // (A response of another wire revision was refused in Handle, which set the status.)
      if (session_status_.ok()) {
        session_status_ = st.ok() ? absl::UnavailableError(absl::StrCat("coordinator at ", address_,
                                                                        " ended the session before answering the "
                                                                        "registration"))
                                  : FromGrpcStatus(st);
      }
      reader_done_ = true;
      return;
    }
    if (!CanResume(st)) {
      // Our own Close ending the stream is a clean end, not a loss (logged at info level only).
      EndSession(absl::UnavailableError(
          closing_ && st.ok()
              ? absl::StrCat("session with coordinator at ", address_, " closed by this worker (", Prefix(), ")")
              : absl::StrCat("session with coordinator at ", address_, " lost (", Prefix(), "): ",
                             st.ok() ? std::string("stream closed") : st.error_message(),
                             closing_ ? "" : "; create a new Worker to register again")));
      reader_done_ = true;
      return;
    }
    log_->warn("{} session with coordinator at {} lost ({}): reconnecting for up to {} ms; decisions already "
               "received stay usable, communicators stay open", Prefix(), address_, st.error_message(),
               absl::ToInt64Milliseconds(options_.reconnect_window));
    mu_.Unlock();
    absl::Status resumed = Resume();
    mu_.Lock();
    if (!resumed.ok()) {
      EndSession(resumed);
      reader_done_ = true;
      return;
    }
  }
}

void Worker::Impl::ReadStream() {
  v1::CoordinatorMessage msg;
  while (stream_->Read(&msg)) {
    PendingAborts aborts;
    {
      absl::MutexLock lock(&mu_);
      Handle(msg, &aborts);
    }
    for (auto& [comm, reason] : aborts.aborts) comm->Abort(reason);
    if (!aborts.acks.empty()) {
      absl::MutexLock lock(&mu_);
      ready_acks_.insert(ready_acks_.end(), aborts.acks.begin(), aborts.acks.end());
    }
  }
}

grpc::Status Worker::Impl::FinishStream() {
  {
    // Finish may only run once the writer no longer writes: stop it first. Its Write
    // fails fast on an ended stream.
    absl::MutexLock lock(&mu_);
    read_ended_ = true;
    auto writer_stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !writer_started_ || writer_done_;
    };
    mu_.Await(absl::Condition(&writer_stopped));
  }
  return stream_->Finish();
}

bool Worker::Impl::CanResume(const grpc::Status& st) const {
  // UNAVAILABLE: the coordinator went away (killed, restarting, unreachable). Any other
  // end is its verdict (declared dead, refused) or our own close.
  return !closing_ && options_.reconnect_window > absl::ZeroDuration() && session_status_.ok() &&
         st.error_code() == grpc::StatusCode::UNAVAILABLE;
}

void Worker::Impl::EndSession(absl::Status why) {
  if (session_status_.ok()) session_status_ = std::move(why);
  // Every pending decision fails now instead of waiting for its deadline.
  queue_.FailPending(session_status_);
  if (!closing_) log_->error("{} {}", Prefix(), std::string(session_status_.message()));
  // Without a session this rank is out of the job: the coordinator already told the others
  // to abort, so our communicators must not go on waiting for them.
  std::vector<std::shared_ptr<internal::AbortableCommunicator>> open = comms_.Open();
  const std::string reason(session_status_.message());
  const bool closing = closing_;
  mu_.Unlock();
  for (auto& c : open) closing ? c->AbortOnClose(reason) : c->Abort(reason);
  mu_.Lock();
}

absl::Status Worker::Impl::Resume() {
  const absl::Time window_end = absl::Now() + options_.reconnect_window;
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    absl::Status s = TryResume(window_end);
    if (s.ok()) return s;
    absl::MutexLock lock(&mu_);
    if (closing_) return absl::CancelledError(absl::StrCat("worker closed while reconnecting (", Prefix(), ")"));
    if (s.code() == absl::StatusCode::kFailedPrecondition || s.code() == absl::StatusCode::kInvalidArgument) {
      return absl::Status(s.code(), absl::StrCat("cannot resume with coordinator at ", address_, " (", Prefix(),
                                                 "): ", s.message()));
    }
    if (absl::Now() + backoff >= window_end) {
      return absl::UnavailableError(absl::StrCat(
          "coordinator at ", address_, " did not come back within the reconnect window (",
          absl::ToInt64Milliseconds(options_.reconnect_window), " ms, WorkerOptions::reconnect_window; ", Prefix(),
          "); last attempt: ", s.message(), "; pending calls fail, create a new Worker to register again"));
    }
    log_->debug("{} resume attempt failed: {}; retrying in {} ms", Prefix(), std::string(s.message()),
                absl::ToInt64Milliseconds(backoff));
    auto closing = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closing_; };
    mu_.AwaitWithTimeout(absl::Condition(&closing), backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
  }
}

absl::Status Worker::Impl::TryResume(absl::Time window_end) {
  const absl::Time attempt_end = std::min(window_end, absl::Now() + absl::Seconds(2));
  if (absl::Status s = Connect(attempt_end); !s.ok()) return s;
  v1::WorkerMessage reg = RegisterMessage();
  {
    absl::MutexLock lock(&mu_);
    *reg.mutable_register_()->mutable_resume() = ResumeStateLocked();
    resume_answered_ = false;
  }
  v1::CoordinatorMessage first;
  bool got = false;
  if (stream_->Write(reg)) {
    // The answer must come by the attempt's end: a coordinator that accepts connections but
    // does not answer (paused) must not hold us past the window.
    std::thread watchdog([this, attempt_end] {
      absl::MutexLock lock(&mu_);
      auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return resume_answered_ || closing_; };
      mu_.AwaitWithDeadline(absl::Condition(&done), attempt_end + absl::Seconds(1));
      if (!resume_answered_) ctx_->TryCancel();
    });
    got = stream_->Read(&first);
    {
      absl::MutexLock lock(&mu_);
      resume_answered_ = true;
    }
    watchdog.join();
  }
  if (!got || !first.has_registered()) {
    if (got) {  // Not an answer to a registration: end the stream ourselves.
      absl::MutexLock lock(&mu_);
      ctx_->TryCancel();
    }
    // The read failed: the stream's status is the coordinator's answer (a refusal says why),
    // or CANCELLED when our watchdog ended a wait with no answer.
    const grpc::Status st = stream_->Finish();
    if (st.error_code() == grpc::StatusCode::CANCELLED) {
      return absl::UnavailableError("the coordinator accepted the connection but did not answer the resume in time");
    }
    return st.ok() ? absl::UnavailableError("the coordinator ended the stream before answering") : FromGrpcStatus(st);
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = OnResumed(first.registered()); !s.ok()) {
    ctx_->TryCancel();
    mu_.Unlock();
    stream_->Finish();
    mu_.Lock();
    return s;
  }
  read_ended_ = false;
  StartWriterLocked();
  return absl::OkStatus();
}

v1::ResumeState Worker::Impl::ResumeStateLocked() {
  v1::ResumeState r;
  r.set_incarnation(incarnation_);
  r.set_group_epoch(group_.epoch);
  resumed_through_.reset();
  for (const auto& p : queue_.Undecided()) {
    ToProto(p, r.add_undecided());
    resumed_through_ = p.key;
  }
  for (const auto& comm : comms_.Open()) {
    auto* c = r.add_comms();
    c->set_name(comm->name());
    c->set_epoch(comm->epoch());
    for (int rank : comm->ranks()) c->add_ranks(rank);
  }
  *r.mutable_previous() = previous_;
  r.set_credential(previous_.resume_credential());
  // Held decisions of the current epoch (the coordinator takes no other: an earlier epoch's
  // were made for a group that re-formed since), newest first, as many as fit the
  // coordinator's 4 MiB message limit (with the registration's manifest): the newest are the
  // ones others may lack.
  const std::vector<MicrobatchDecision> held = queue_.Held();
  size_t bytes = r.ByteSizeLong() + RegisterMessage().ByteSizeLong();
  for (auto it = held.rbegin(); it != held.rend(); ++it) {
    if (it->epoch != group_.epoch) continue;
    v1::MicrobatchDecision d;
    ToProto(*it, &d);
    bytes += d.ByteSizeLong() + 8;
    if (bytes > internal::kResumeMaxBytes) break;
    *r.add_held() = std::move(d);
  }
  return r;
}

absl::Status Worker::Impl::OnResumed(const v1::RegisterResponse& r) {
  if (r.incarnation() < incarnation_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "it answered as coordinator incarnation ", r.incarnation(), ", older than incarnation ", incarnation_,
        " this rank was registered with: a stale coordinator process serves that address"));
  }
  const bool restarted = r.incarnation() != incarnation_;
  incarnation_ = r.incarnation();
  session_key_->Set(r.session_key());
  previous_ = r;
  // Plans the resume carried are not sent again; plans reported after it was built (while
  // the answer was on its way) still are.
  while (!outbox_.empty() && resumed_through_ &&
         !(*resumed_through_ < KeyOf(outbox_.front()))) {
    outbox_.pop_front();
  }
  ready_acks_.clear();   // Acknowledgements of the old process's aborts.
  ResendCosts();         // A new coordinator process knows none of them.
  if (r.epoch() != group_.epoch) {
    // The group re-formed meanwhile (it failed while we were away): keys start afresh.
    const int cancelled = queue_.FailPending(absl::AbortedError(absl::StrCat(
        "group ", group_.group, " re-formed at epoch ", r.epoch(), " while rank ", options_.rank,
        " was reconnecting; plan again")));
    queue_.ResetKeys();
    group_.epoch = r.epoch();
    group_failure_.clear();
    log_->warn("{} group re-formed at epoch {} while reconnecting ({} pending decisions cancelled)", Prefix(),
               r.epoch(), cancelled);
  }
  log_->warn("{} resumed with coordinator at {} ({} incarnation {}), group {} epoch {}", Prefix(), address_,
             restarted ? "restarted, new" : "same", incarnation_, group_.group, group_.epoch);
  return absl::OkStatus();
}

void Worker::Impl::StartWriterLocked() {
  if (writer_.joinable()) writer_.join();  // The last session's writer has ended (writer_done_).
  writer_started_ = true;
  writer_done_ = false;
  writer_ = std::thread([this] { WriterLoop(); });
}

std::string Worker::Impl::UnusableDecision(const v1::MicrobatchDecision& d) const {
  // One entry per module of this rank's manifest, in its order, each a decision it can take.
  if (d.modules_size() != static_cast<int>(options_.modules.size())) {
    return absl::StrCat("it names ", d.modules_size(), " modules, the manifest has ", options_.modules.size());
  }
  for (int i = 0; i < d.modules_size(); ++i) {
    const auto& m = d.modules(i);
    if (m.module() != options_.modules[i].name) {
      return absl::StrCat("entry ", i, " is for module '", Printable(m.module(), 64), "', not '",
                          options_.modules[i].name, "'");
    }
    if (!KnownDecision(m.decision())) {
      return absl::StrCat("module '", m.module(), "' has decision value ", static_cast<int>(m.decision()),
                          ", which is no decision this worker knows");
    }
    if (m.decision() == v1::DECISION_PADDED && !PassesFit(Decision::kPadded, m.calls())) {
      return absl::StrCat("module '", m.module(), "' is decided padded with ", m.calls(),
                          " passes; a padded decision has 1 to ", kMaxCallsPerModule);
    }
  }
  return "";
}

void Worker::Impl::Handle(const v1::CoordinatorMessage& msg, PendingAborts* aborts) {
  if (msg.incarnation() != 0 && incarnation_ != 0 && msg.incarnation() != incarnation_ && !msg.has_registered()) {
    log_->warn("{} ignored a message of coordinator incarnation {} (registered with {})", Prefix(), msg.incarnation(),
               incarnation_);
    return;
  }
  switch (msg.kind_case()) {
    case v1::CoordinatorMessage::kRegistered:
      if (std::string why = WireMismatch(msg.registered().wire_revision(), "the coordinator at " + address_);
          !why.empty()) {
        // Nothing it would send could be read right: end the session, saying why.
        if (session_status_.ok()) session_status_ = absl::FailedPreconditionError(why);
        ctx_->TryCancel();
        break;
      }
      OnRegistered(msg.registered());
      break;
    case v1::CoordinatorMessage::kDecisions:
      OnDecisions(msg.decisions());
      break;
    case v1::CoordinatorMessage::kPlanRejected:
      OnPlanRejected(msg.plan_rejected());
      break;
    case v1::CoordinatorMessage::kMicrobatchFailed: {
      const auto& f = msg.microbatch_failed();
      if (!f.has_key()) {
        FailKeyless("a microbatch failure", f.message());
        break;
      }
      const MicrobatchKey key = KeyOf(f);
      log_->error("{} step={} mb={} microbatch failed: {}", Prefix(), key.step, key.microbatch, f.message());
      queue_.Fail(key, MakeStatus(f.code(), f.message()));  // Also a decision not taken yet.
      break;
    }
    case v1::CoordinatorMessage::kGroupFailure: {
      const auto& g = msg.group_failure();
      group_failure_ = g.reason();
      outbox_.clear();  // Plans for the failed epoch must not reach the next one.
      const int cancelled = queue_.FailPending(absl::AbortedError(g.reason()));
      log_->error("{} {} (cancelled {} pending decisions here)", Prefix(), g.reason(), cancelled);
      break;
    }
    case v1::CoordinatorMessage::kCommAbort: {
      const auto& a = msg.comm_abort();
      if (auto comm = comms_.Find(a.name(), a.epoch())) aborts->aborts.emplace_back(comm, a.reason());
      // Acknowledged once aborted (the reader does it right after, see ReaderLoop): the
      // coordinator starts the next epoch only when every live member has.
      aborts->acks.push_back({a.name(), a.epoch()});
      break;
    }
    case v1::CoordinatorMessage::kNotice:
      OnNotice(msg.notice());
      break;
    default:
      break;
  }
}

void Worker::Impl::OnRegistered(const v1::RegisterResponse& r) {
  incarnation_ = r.incarnation();
  coordinator_version_ = r.coordinator_version();
  session_key_->Set(r.session_key());
  previous_ = r;
  group_.group = r.group();
  group_.ranks.assign(r.group_ranks().begin(), r.group_ranks().end());
  group_.epoch = r.epoch();
  group_.policy = FromProto(r.policy());
  group_.fallback = FromProto(r.fallback());
  group_.lookahead = r.lookahead();
  group_.heartbeat_interval = absl::Milliseconds(r.heartbeat_interval_ms());
  group_.warnings.assign(r.warnings().begin(), r.warnings().end());
  registered_ = true;
  ResendCosts();  // A registration starts the rank afresh at the coordinator: measures included.
}

void Worker::Impl::OnDecisions(const v1::DecisionBatch& batch) {
  for (const auto& pd : batch.decisions()) {
    if (!pd.has_key()) {
      FailKeyless("a decision", "");
      continue;
    }
    const MicrobatchKey key = KeyOf(pd);
    if (std::string why = UnusableDecision(pd); !why.empty()) {
      // Never handed to the trainer: it could not carry it out (and a guess could hang).
      log_->error("{} step={} mb={} refused a decision it cannot carry out: {}", Prefix(), key.step,
                  key.microbatch, why);
      queue_.Fail(key, absl::InternalError(absl::StrCat("the coordinator's decision for ", key.ToString(),
                                                        " cannot be carried out: ", why)));
      continue;
    }
    queue_.Decide(key, FromProto(pd));  // Ignored unless pending.
  }
}

void Worker::Impl::FailKeyless(const std::string& what, const std::string& detail) {
  // Which microbatch it is about is unknown: nothing pending can be decided safely.
  const std::string why = absl::StrCat("the coordinator sent ", what, " without a key (which microbatch it names is "
                                       "unknown)", detail.empty() ? "" : ": ", detail);
  log_->error("{} {}", Prefix(), why);
  queue_.FailPending(absl::FailedPreconditionError(why));
}

void Worker::Impl::OnPlanRejected(const v1::PlanRejected& r) {
  if (!r.has_key()) {
    FailKeyless("a plan rejection", r.message());
    return;
  }
  const MicrobatchKey key = KeyOf(r);
  if (r.epoch() != group_.epoch) {
    // Sent before the group failed, rejected after it re-formed: not about this epoch's plan.
    log_->debug("{} step={} mb={} epoch {} plan rejected after re-forming: {}", Prefix(), key.step,
                key.microbatch, r.epoch(), r.message());
    return;
  }
  log_->warn("{} step={} mb={} plan rejected: {}", Prefix(), key.step, key.microbatch, r.message());
  queue_.Reject(key, MakeStatus(r.code(), r.message()));
}

void Worker::Impl::OnNotice(const v1::Notice& n) {
  if (n.kind() == v1::Notice::KIND_GROUP_REFORMED) {
    group_failure_.clear();
    group_.epoch = n.epoch();
    queue_.ResetKeys();  // Keys start afresh in the new epoch (the coordinator's rule).
    log_->info("{} {}", Prefix(), n.message());
  } else if (n.kind() == v1::Notice::KIND_RANK_LOST) {
    if (job_failure_.empty()) {  // The first loss is the cause; later ones follow from it.
      job_failure_ = absl::StrCat("rank ", n.rank(), " of another shard group of this job was lost: ", n.message());
    }
    log_->error("{} {}", Prefix(), job_failure_);
  } else if (n.kind() == v1::Notice::KIND_SHUTDOWN) {
    if (options_.reconnect_window > absl::ZeroDuration()) {
      log_->warn("{} {}: will reconnect when it is back", Prefix(), n.message());
    } else {
      session_status_ =
          absl::UnavailableError(absl::StrCat("coordinator at ", address_, " is shutting down (", Prefix(), ")"));
      log_->warn("{} {}", Prefix(), n.message());
    }
  }
}

void Worker::Impl::FillHeartbeat(v1::Heartbeat* hb) {
  hb->set_sent_unix_ms(absl::ToUnixMillis(absl::Now()));
  hb->set_decision_stalls(decision_stalls_);
  hb->set_decision_stall_us(absl::ToInt64Microseconds(decision_stall_time_));
  for (const auto& progress : comms_.Snapshot()) {
    auto* p = hb->add_comms();
    p->set_name(progress.name);
    p->set_epoch(progress.epoch);
    p->set_issued(progress.issued);
    p->set_completed(progress.completed);
  }
  for (const ModuleMemoryUsage& m : memory_) ToProto(m, hb->add_memory());
  // Costs only when new, and not more often than kCostReportInterval: the coordinator
  // recomputes its group's model from them (DESIGN 3).
  const absl::Time now = absl::Now();
  if (!costs_dirty_ || now < costs_sent_ + kCostReportInterval) return;
  costs_dirty_ = false;
  costs_sent_ = now;
  hb->set_frozen_budget_bytes(frozen_budget_bytes_);
  for (const ModuleCost& c : costs_) ToProto(c, hb->add_costs());
}

void Worker::Impl::TakeOutbox(v1::PlanBatch* batch) {
  batch->set_epoch(group_.epoch);
  // At most a window's worth per message (the coordinator cuts a rank whose batch is far
  // beyond its window); the writer loops at once for the rest.
  const int most = std::max(1, group_.lookahead);
  while (!outbox_.empty() && batch->plans_size() < most) {
    *batch->add_plans() = std::move(outbox_.front());
    outbox_.pop_front();
  }
}

void Worker::Impl::WriterLoop() {
  absl::Duration interval;
  {
    absl::MutexLock lock(&mu_);
    interval = group_.heartbeat_interval > absl::ZeroDuration() ? group_.heartbeat_interval
                                                                : absl::Milliseconds(500);
  }
  absl::Time last_heartbeat = absl::Now();
  while (true) {
    v1::WorkerMessage msg;
    bool goodbye = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !outbox_.empty() || !ready_acks_.empty() || memory_dirty_ || CostsDue() || closing_ || read_ended_;
      };
      mu_.AwaitWithDeadline(absl::Condition(&ready), last_heartbeat + interval);
      if (read_ended_) break;
      msg.set_incarnation(incarnation_);
      // Heartbeats go out on time even while plans flow: they carry collective progress.
      const bool heartbeat_due = absl::Now() >= last_heartbeat + interval || (memory_dirty_ && outbox_.empty());
      // Measures go before the plans of the same message: a cost report made before the first
      // plan is in force when that plan is decided (the coordinator takes a bundle's heartbeat
      // first).
      const bool measures = memory_dirty_ || CostsDue();
      if (heartbeat_due || measures || !ready_acks_.empty() || !outbox_.empty()) {
        // Everything queued, in one message (DESIGN 7, "Messages").
        auto* bundle = msg.mutable_bundle();
        if (heartbeat_due || measures) {
          FillHeartbeat(bundle->mutable_heartbeat());
          memory_dirty_ = false;
          last_heartbeat = absl::Now();
        }
        for (const auto& [name, epoch] : ready_acks_) {
          auto* ack = bundle->add_comm_aborted();
          ack->set_name(name);
          ack->set_epoch(epoch);
        }
        ready_acks_.clear();
        if (!outbox_.empty()) TakeOutbox(bundle->mutable_plans());
      } else if (closing_) {
        msg.mutable_goodbye()->set_reason(close_reason_);
        msg.mutable_goodbye()->set_failed(close_failed_);
        goodbye = true;
      } else {
        continue;  // Woken early with nothing to send.
      }
    }
    if (!stream_->Write(msg)) break;  // The reader sees the end and records why.
    if (goodbye) {
      stream_->WritesDone();
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  writer_done_ = true;
}

}  // namespace shardcoord
