// The kinds of event the daemon records (EventJournal, `shardctl events`, the metric
// shardcoord_events_total{kind}): one list, so that the journal, the log and the counters
// cannot disagree and a new kind has its counter, at zero, from the daemon's start.
#ifndef SHARDCOORD_COORDINATOR_JOURNAL_EVENT_KIND_H_
#define SHARDCOORD_COORDINATOR_JOURNAL_EVENT_KIND_H_

#include <cstddef>

namespace shardcoord::coordinator {

// How much an event matters: its log level, and the journal's `severity` column.
enum class Severity { kInfo, kWarning, kError };
constexpr const char* SeverityName(Severity s) {
  return s == Severity::kError ? "error" : s == Severity::kWarning ? "warning" : "info";
}

// X(enumerator, name as journaled): the one definition of every kind.
#define SHARDCOORD_EVENT_KINDS(X)                                 \
  X(kDaemonStarted, "daemon_started")                             \
  X(kDaemonStopped, "daemon_stopped")                             \
  X(kCoordinatorPaused, "coordinator_paused")                     \
  X(kJobCreated, "job_created")                                   \
  X(kJobReplaced, "job_replaced")                                 \
  X(kJobRerun, "job_rerun")                                       \
  X(kJobEvicted, "job_evicted")                                   \
  X(kRankRegistered, "rank_registered")                           \
  X(kRankRejoined, "rank_rejoined")                               \
  X(kRankResumed, "rank_resumed")                                 \
  X(kRankLeft, "rank_left")                                       \
  X(kRankDead, "rank_dead")                                       \
  X(kResumeUnverified, "resume_unverified")                       \
  X(kResumeRefused, "resume_refused")                             \
  X(kRankSuperseded, "rank_superseded")                           \
  X(kPerLayerRequested, "per_layer_requested")                    \
  X(kGroupFormed, "group_formed")                                 \
  X(kGroupReformed, "group_reformed")                             \
  X(kGroupFailed, "group_failed")                                 \
  X(kGroupRecovering, "group_recovering")                         \
  X(kGroupRecovered, "group_recovered")                           \
  X(kGroupRecoveryFailed, "group_recovery_failed")                \
  X(kRecoveryExpired, "recovery_expired")                         \
  X(kMicrobatchFailed, "microbatch_failed")                       \
  X(kModulePromoted, "module_promoted")                           \
  X(kModuleDemoted, "module_demoted")                             \
  X(kModuleStickyReplicate, "module_sticky_replicate")            \
  X(kModuleCostChoice, "module_cost_choice")                      \
  X(kModuleTrainableRoot, "module_trainable_root")                \
  X(kGroupCostModel, "group_cost_model")                          \
  X(kCommForming, "comm_forming")                                 \
  X(kCommReady, "comm_ready")                                     \
  X(kCommClosed, "comm_closed")                                   \
  X(kCommAborted, "comm_aborted")                                 \
  X(kCommRankBehind, "comm_rank_behind")                          \
  X(kCommRecovered, "comm_recovered")

enum class EventKind {
#define SHARDCOORD_EVENT_ENUMERATOR(e, name) e,
  SHARDCOORD_EVENT_KINDS(SHARDCOORD_EVENT_ENUMERATOR)
#undef SHARDCOORD_EVENT_ENUMERATOR
};

inline constexpr const char* kEventKindNames[] = {
#define SHARDCOORD_EVENT_NAME(e, name) name,
    SHARDCOORD_EVENT_KINDS(SHARDCOORD_EVENT_NAME)
#undef SHARDCOORD_EVENT_NAME
};

inline constexpr size_t kEventKindCount = sizeof(kEventKindNames) / sizeof(kEventKindNames[0]);

constexpr const char* EventKindName(EventKind k) { return kEventKindNames[static_cast<size_t>(k)]; }

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_JOURNAL_EVENT_KIND_H_
