// CoordinatorCore's base: construction, events, finding a session's member, and the send
// path every part uses, Apply (a group's effects) included. The group's own rules (plans,
// decisions, its state machine, recovery) are ShardGroup's (shard_group*.cc). The parts, each
// using only those listed before it and this base: _groups.cc (a rank becoming live, the
// rest of the job hearing of a death), _comms.cc (communicators, through the job's CommTable), _recovery.cc (groups after a
// coordinator restart), _liveness.cc (bundles and heartbeats, leaves, deaths, the tick),
// _registration.cc (ranks joining); _status.cc (the views operators query) reads only.
#include "coordinator/core/coordinator_core.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/core/daemon_metrics.h"
#include "coordinator/core/registration.h"
#include "coordinator/core/secrets.h"
#include "coordinator/engine/text.h"
#include "shardcoord/decide.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/version.h"

namespace shardcoord::coordinator {

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
      buffers_(std::make_shared<BufferBudget>(options_.limits.max_buffered_bytes)),
      runs_file_(RunPinsPath(options_.state_file)) {
  if (runs_file_.empty()) return;
  absl::StatusOr<RunPins> pins = ReadRunPins(runs_file_);
  if (pins.ok()) {
    pinned_runs_ = *std::move(pins);
    written_runs_ = pinned_runs_;
  } else if (!absl::IsNotFound(pins.status())) {
    logging::Get("coordinator")->warn("{}; no run is known, so no job of the last start can resume (restart them)",
                                      std::string(pins.status().message()));
  }
}

CoordinatorCore::~CoordinatorCore() = default;

void CoordinatorCore::Event(Severity severity, EventKind kind,
                            const std::string& job, int rank, int group,
                            const std::string& message) {
  journal_.Add(clock_->Now(), severity, kind, job, rank, group, message);
  metrics_->CountEvent(kind);
  const auto level = severity == Severity::kError     ? spdlog::level::err
                     : severity == Severity::kWarning ? spdlog::level::warn
                                                      : spdlog::level::info;
  // Only what the event concerns: a daemon event has no job, a job's none of rank or group.
  std::string line = absl::StrCat("event=", EventKindName(kind));
  if (!job.empty()) absl::StrAppend(&line, " job=", job);
  if (rank >= 0) absl::StrAppend(&line, " rank=", rank);
  if (group >= 0) absl::StrAppend(&line, " group=", group);
  absl::StrAppend(&line, " ", message);
  mu_.Defer([level, line = std::move(line)] {
    static const auto log = logging::Get("coordinator");
    log->log(level, "{}", line);
  });
}

const Member* CoordinatorCore::LiveIn(ShardGroup& group, int rank, uint64_t session_id) {
  const Member& m = group.member(rank);
  return group.binding(rank).session == session_id && m.live() ? &m : nullptr;
}

CoordinatorCore::HeldGroup::HeldGroup(const Job& job, const GroupSlot& slot) : slot_(slot) {
  const bool free = slot.mu.LockNested();
  SHARDCOORD_INVARIANT(free, absl::StrCat("group ", slot.group.index(), " of job '", job.id,
                                          "' was locked by another thread while the core's lock was held exclusively"));
}

const Member* CoordinatorCore::LiveMember(uint64_t session_id, Job** job) {
  const SessionRef* ref = jobs_.FindSession(session_id);
  if (ref == nullptr) return nullptr;
  GroupSlot& slot = SlotOf(*ref->job, ref->rank);
  HeldGroup held(*ref->job, slot);
  const Member* m = LiveIn(slot.group, ref->rank, session_id);
  if (m != nullptr) *job = ref->job;
  return m;
}

void CoordinatorCore::Apply(Job& job, ShardGroup& group, GroupEffects& fx) {
  if (fx.empty()) return;  // Most heartbeats: no scan of the members.
  bool batched = false;
  // A decision is serialized once, for the first member that takes it, and shared with the
  // others (decision_wire.h): every member gets the same bytes.
  EncodedDecision encoded;
  const auto deliver = [&](int idx, const GroupEffects::Message& out) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Member& m = group.members()[idx];
    SessionBinding& b = group.binding_at(idx);
    if (!out.decision) {
      SendTo(m, b, out.message);
    } else if (m.live() && b.sink) {
      if (!encoded) encoded = EncodeDecision(*out.decision);
      b.outgoing.push_back(encoded);
      batched = true;
    }
  };
  for (auto& [idx, why] : fx.cuts) {
    SessionBinding& b = group.binding_at(idx);
    if (b.cut_reason.empty()) b.cut_reason = std::move(why);
  }
  const int size = group.size();
  for (const GroupEffects::Message& out : fx.messages) {
    encoded.reset();
    if (out.member != GroupEffects::kEveryMember) {
      deliver(out.member, out);
      continue;
    }
    for (int i = 0; i < size; ++i) deliver(i, out);
  }
  if (batched) Flush(group);
  job.plans_received += fx.plans_accepted;
  job.microbatches_decided += fx.decided;
  for (const absl::Duration latency : fx.decision_latencies) metrics_->ObserveDecisionLatency(latency);
  if (fx.recovered) metrics_->ObserveGroupRecovery(clock_->Now() - started_);
  for (GroupEffects::Event& e : fx.events) Event(e.severity, e.kind, job.id, e.rank, group.index(), e.message);
  static logging::RateLimit limit(10);  // A client sending 10^5 bad plans gets 10 lines a second.
  for (std::string& line : fx.warnings) {
    int64_t suppressed = 0;
    if (!limit.Allow(&suppressed)) continue;
    if (suppressed > 0) absl::StrAppend(&line, " (", suppressed, " more warnings not logged)");
    mu_.Defer([line = std::move(line)] {
      static const auto log = logging::Get("coordinator");
      log->warn("{}", line);
    });
  }
  fx.Clear();
}

void CoordinatorCore::Flush(ShardGroup& group) {
  for (int i = 0; i < group.size(); ++i) SendBatched(group.binding_at(i));
}

void CoordinatorCore::SendBatched(SessionBinding& b) {
  if (b.outgoing.empty()) return;
  std::vector<EncodedDecision> batch;
  batch.swap(b.outgoing);
  if (!b.sink || !b.cut_reason.empty()) return;
  OnQueued(b, b.sink->SendDecisions(std::move(batch)));
}

void CoordinatorCore::SendTo(const Member& m, SessionBinding& b, const v1::CoordinatorMessage& msg) {
  if (m.state != v1::RANK_STATE_LIVE || !b.sink) return;
  SendBatched(b);  // Decisions batched so far go first: the rank sees messages in the order produced.
  SinkSend(b, msg);
}

void CoordinatorCore::SinkSend(SessionBinding& b, v1::CoordinatorMessage msg) {
  if (!b.sink || !b.cut_reason.empty()) return;
  // Refused: the rank is not reading. Tick fails it (not here: we may be deep inside a
  // group's state change); until then nothing more is queued for it.
  OnQueued(b, b.sink->Send(std::move(msg)));
}

void CoordinatorCore::OnQueued(SessionBinding& b, const absl::Status& queued) {
  if (!queued.ok()) {
    b.cut_reason = std::string(queued.message());
    return;
  }
  mu_.Kick(b.sink);  // The write starts once mu_ is released.
}

void CoordinatorCore::RecordDaemonEvent(bool started, const std::string& detail) {
  CoreLock lock(&mu_);
  Event(Severity::kInfo, started ? EventKind::kDaemonStarted : EventKind::kDaemonStopped, "", -1, -1,
        absl::StrCat("shardcoord ", kVersion, " incarnation ", incarnation_, ": ", detail));
}

}  // namespace shardcoord::coordinator
