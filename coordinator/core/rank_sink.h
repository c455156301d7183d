// RankSink: the core's handle on one rank's session stream (the server's SessionSink,
// session_stream.h; a recording sink in tests).
#ifndef SHARDCOORD_COORDINATOR_CORE_RANK_SINK_H_
#define SHARDCOORD_COORDINATOR_CORE_RANK_SINK_H_

#include "absl/status/status.h"
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
  virtual absl::Status Send(const v1::CoordinatorMessage& msg) = 0;
  // Starts writing what Send queued, if no write is in flight. The core calls it after
  // releasing its mutex, once per call that queued something for the rank: starting a
  // network write is the costly part of sending, and must not hold up every other rank.
  virtual void Kick() {}
  // Ends the session with `status` once the queued messages are written.
  virtual void Close(const absl::Status& status) = 0;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_RANK_SINK_H_
