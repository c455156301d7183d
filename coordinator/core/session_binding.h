// SessionBinding: the core's side of one member of a shard group, its live session (DESIGN 9).
#ifndef SHARDCOORD_COORDINATOR_CORE_SESSION_BINDING_H_
#define SHARDCOORD_COORDINATOR_CORE_SESSION_BINDING_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/core/decision_wire.h"
#include "coordinator/core/rank_sink.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

// The stream a rank is sent on, the session's id and key, the registration that answered it, the
// decisions batched for it during one CoordinatorCore::Apply, and why it is to be cut. Only the
// core reads or writes it; the group's rules (Member, ShardGroup) never see a session. It is kept
// by the group beside its Member (ShardGroup::binding), under the group's mutex, because the plan
// path, which holds the core's lock only shared, batches decisions into it.
struct SessionBinding {
  uint64_t session = 0;  // 0: none.
  std::shared_ptr<RankSink> sink;
  std::string session_key;    // Of the live session (RegisterResponse.session_key).
  uint64_t registration = 0;  // The serial of the live session's answer (RegisterResponse.registration).
  // Decisions batched during one CoordinatorCore::Apply, each shared with the group's other members.
  std::vector<EncodedDecision> outgoing;
  // Why the rank is to be failed at the next tick ("" while it is not): its sink refused a send
  // (it does not read), or it broke the protocol (GroupEffects::cuts). Nothing more is sent to it.
  std::string cut_reason;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_SESSION_BINDING_H_
