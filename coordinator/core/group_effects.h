// GroupEffects: what one of ShardGroup's operations asks of the world outside the group.
//
// A group never sends, journals, logs or counts by itself: its operations change the group and
// append here what follows from the change, in the order it happened, and the core carries
// it out under the group's lock (CoordinatorCore::Apply): the messages go to the members'
// sinks (which only queue; the writes start after unlocking), the events to the journal, the
// log lines and counters after. So the group's rules can be read, and tested, as state in,
// state and effects out.
#ifndef SHARDCOORD_COORDINATOR_CORE_GROUP_EFFECTS_H_
#define SHARDCOORD_COORDINATOR_CORE_GROUP_EFFECTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/journal/event_kind.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

struct GroupEffects {
  // A message's member: its index in the group, or every member of the group. Only live
  // members with a session receive (as of when the effects are carried out).
  static constexpr int kEveryMember = -1;
  struct Message {
    int member = kEveryMember;
    // A decision is batched with the member's other decisions of the same operation into one
    // message; any other message first sends the batch, so a member sees them in order.
    std::optional<v1::MicrobatchDecision> decision;
    v1::CoordinatorMessage message;
  };
  struct Event {
    Severity severity = Severity::kInfo;
    EventKind kind;
    int rank = -1;  // -1: the group's, not one rank's.
    std::string message;
  };

  std::vector<Message> messages;
  std::vector<Event> events;
  std::vector<std::string> warnings;  // Log lines, written after unlocking (10 a second at most).
  std::vector<absl::Duration> decision_latencies;  // First report to decision, per decision.
  // Members to cut at the next tick (index, why): they broke the protocol. The core keeps the
  // first reason of each (SessionBinding::cut_reason) and sends them nothing more.
  std::vector<std::pair<int, std::string>> cuts;
  int64_t plans_accepted = 0;
  int64_t decided = 0;    // Decisions given (the job's counter).
  bool recovered = false;  // The group recovered after a restart (its time goes to a histogram).

  void Send(int member, v1::CoordinatorMessage msg) { messages.push_back({member, std::nullopt, std::move(msg)}); }
  void Decide(int member, v1::MicrobatchDecision d) { messages.push_back({member, std::move(d), {}}); }
  void Record(Severity severity, EventKind kind, int rank, std::string message) {
    events.push_back({severity, kind, rank, std::move(message)});
  }
  // Empties it for the next operation, keeping the vectors' room: the plan path reuses one per
  // group (ShardGroup::effects), so a decision costs no allocation of this list.
  void Clear() {
    messages.clear();
    events.clear();
    warnings.clear();
    decision_latencies.clear();
    cuts.clear();
    plans_accepted = decided = 0;
    recovered = false;
  }
  bool empty() const {
    return messages.empty() && events.empty() && warnings.empty() && decision_latencies.empty() && cuts.empty() &&
           plans_accepted == 0 && decided == 0 && !recovered;
  }
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_GROUP_EFFECTS_H_
