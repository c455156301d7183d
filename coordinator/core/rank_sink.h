// RankSink: the core's handle on one rank's session stream (the server's SessionSink,
// session_stream.h; a recording sink in tests).
#ifndef SHARDCOORD_COORDINATOR_CORE_RANK_SINK_H_
#define SHARDCOORD_COORDINATOR_CORE_RANK_SINK_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/core/decision_wire.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

class RankSink {
 public:
  virtual ~RankSink() = default;
  // Queues `msg` for the rank. Must not block and must not call into CoordinatorCore.
  // Refuses (RESOURCE_EXHAUSTED naming the bound), and queues nothing, when the rank's
  // queue is over its bound or the daemon's buffers are full while the rank holds a large
  // share of them (it does not read its stream): the core then fails the rank with that
  // message.
  // Takes `msg` (moved in where the caller is done with it: no copy on the hot path).
  virtual absl::Status Send(v1::CoordinatorMessage msg) = 0;
  // Queues one message of decisions, `batch` in order, as Send would queue
  // CoordinatorMessage{decisions: batch}: the same bound, the same refusal. The decisions are
  // shared with the other members' sinks (decision_wire.h), never changed.
  virtual absl::Status SendDecisions(std::vector<EncodedDecision> batch) = 0;
  // Starts writing what Send queued, if no write is in flight. The core calls it after
  // releasing its mutex, once per call that queued something for the rank: starting a
  // network write is the costly part of sending, and must not hold up every other rank.
  virtual void Kick() {}
  // Ends the session with `status` once the queued messages are written.
  virtual void Close(const absl::Status& status) = 0;

  // For the daemon-wide buffer budget (BufferBudget): the bytes the rank's queue holds, and
  // since when its write in flight has been waiting for the rank to read (InfiniteFuture: no
  // write waiting). A rank that reads is never the one cut for the budget.
  struct Backlog {
    int64_t charged = 0;
    absl::Time stalled_since = absl::InfiniteFuture();
  };
  virtual Backlog backlog() const { return {}; }
  // The core cuts the rank for not reading: at Close, what is queued is dropped (its bytes go
  // back to the budget) instead of waiting behind a write that never completes.
  virtual void CutForNotReading() {}
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_RANK_SINK_H_
