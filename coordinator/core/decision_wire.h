// A group's decision serialized once for all of its members (DESIGN 9, "One decision, one
// serialization").
//
// A decision is identical for every rank of its group. Built as each rank's own protobuf, a
// decision to a group of G cost G - 1 deep copies (its key, its seal, every module entry), G
// serializations and G destructions: the largest part of the daemon's time per plan after gRPC
// itself (docs/BENCHMARKS.md). Instead, the core serializes it once, as the bytes of one
// `DecisionBatch.decisions` entry, and every member's outbox holds a reference to those bytes;
// the session stream assembles each write to a rank from them. Protobuf's wire format makes that
// exact: the entries of a repeated field concatenate, and the bytes written are the ones
// `CoordinatorMessage::SerializeAsString` gives for the same message (decision_wire_test).
#ifndef SHARDCOORD_COORDINATOR_CORE_DECISION_WIRE_H_
#define SHARDCOORD_COORDINATOR_CORE_DECISION_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

// One decision as the wire bytes of one `DecisionBatch.decisions` entry (field tag, length,
// the serialized MicrobatchDecision). Immutable; shared by every outbox that sends it.
using EncodedDecision = std::shared_ptr<const std::string>;

EncodedDecision EncodeDecision(const v1::MicrobatchDecision& decision);

// The wire size of CoordinatorMessage{decisions: `batch`, incarnation: `incarnation`}.
size_t DecisionsMessageSize(absl::Span<const EncodedDecision> batch, uint64_t incarnation);
// Writes that message's DecisionsMessageSize bytes at `out`.
void WriteDecisionsMessage(absl::Span<const EncodedDecision> batch, uint64_t incarnation, uint8_t* out);

// The message those bytes are (for a sink that keeps what it is sent as protobufs: tests).
// INTERNAL when an entry does not parse, which only a bug here can cause.
absl::StatusOr<v1::CoordinatorMessage> DecodeDecisions(absl::Span<const EncodedDecision> batch);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_DECISION_WIRE_H_
