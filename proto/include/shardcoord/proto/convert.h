// Conversions between shardcoord.v1 wire messages and the contract's value types, and
// between absl::Status and grpc::Status (same codes, same messages). Pure functions.
#ifndef SHARDCOORD_PROTO_CONVERT_H_
#define SHARDCOORD_PROTO_CONVERT_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "shardcoord/cost.h"
#include "shardcoord/types.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord {

inline v1::Policy ToProto(Policy p) { return static_cast<v1::Policy>(p); }
inline v1::Fallback ToProto(Fallback f) { return static_cast<v1::Fallback>(f); }
inline v1::Decision ToProto(Decision d) { return static_cast<v1::Decision>(d); }
inline v1::DecisionReason ToProto(DecisionReason r) { return static_cast<v1::DecisionReason>(r); }
inline Policy FromProto(v1::Policy p) { return static_cast<Policy>(p); }
inline Fallback FromProto(v1::Fallback f) { return static_cast<Fallback>(f); }
inline Decision FromProto(v1::Decision d) { return static_cast<Decision>(d); }
inline DecisionReason FromProto(v1::DecisionReason r) { return static_cast<DecisionReason>(r); }

// The revision of the wire this build speaks (RegisterRequest/RegisterResponse.wire_revision):
// 2, every microbatch named by a MicrobatchKey; 3, a resume proving its run and registration
// (RegisterResponse.run_id, .registration), without which a revision-2 resume is refused after
// the restart anyway. Peers of different revisions refuse each other at registration.
inline constexpr uint32_t kWireRevision = 3;
// Why a peer that speaks wire revision `theirs` cannot talk to this build ("" when it can).
std::string WireMismatch(uint32_t theirs, const std::string& peer);

void ToProto(const MicrobatchKey& k, v1::MicrobatchKey* out);
MicrobatchKey FromProto(const v1::MicrobatchKey& k);
// The key of a wire message that names a microbatch (MicrobatchPlan, MicrobatchDecision,
// PlanRejected, MicrobatchFailed): the one conversion, so that code past the message speaks
// MicrobatchKey.
template <typename Message>
MicrobatchKey KeyOf(const Message& m) {
  return FromProto(m.key());
}

void ToProto(const ModuleSpec& m, v1::ModuleSpec* out);
ModuleSpec FromProto(const v1::ModuleSpec& m);

// What a worker measures (Heartbeat.memory, Heartbeat.costs), and the daemon shows back
// (RankStatus.memory).
void ToProto(const ModuleMemoryUsage& m, v1::ModuleMemory* out);
ModuleMemoryUsage FromProto(const v1::ModuleMemory& m);
void ToProto(const ModuleCost& c, v1::ModuleCostReport* out);
ModuleCost FromProto(const v1::ModuleCostReport& c);

void ToProto(const MicrobatchPlan& p, v1::MicrobatchPlan* out);
MicrobatchPlan FromProto(const v1::MicrobatchPlan& p);

void ToProto(const MicrobatchDecision& d, v1::MicrobatchDecision* out);
MicrobatchDecision FromProto(const v1::MicrobatchDecision& d);

grpc::Status ToGrpcStatus(const absl::Status& s);
absl::Status FromGrpcStatus(const grpc::Status& s);
// For codes carried inside messages (PlanRejected, MicrobatchFailed).
absl::Status MakeStatus(int code, const std::string& message);

// An enum value name as operators read it: without `prefix`, lower case
// (EnumText("REASON_DIVERGENT", "REASON_") -> "divergent").
std::string EnumText(std::string name, const std::string& prefix);
// A state as operators read it: the enum name without its prefix, lower case
// (RANK_STATE_LIVE -> "live", GROUP_STATE_HEALTHY -> "healthy", COMM_STATE_ABORTED -> "aborted").
std::string StateName(v1::RankState s);
std::string StateName(v1::GroupState s);
std::string StateName(v1::CommState s);

// Whether a job is over (the status page and `shardctl watch` show it collapsed, after the live
// ones): no rank is live and none waits to resume, and some rank left or died (a job whose
// counts say nothing is shown in full rather than hidden).
bool JobIsOver(const v1::JobStatus& job);

// A decision value this version defines (DECISION_UNSPECIFIED and values from newer peers are not).
inline bool KnownDecision(int value) {
  return value != v1::DECISION_UNSPECIFIED && v1::Decision_IsValid(value);
}

// Adds every count of `add` to `sum` (decisions by kind, divergent ones).
void AddDecisionCounts(const v1::DecisionCounts& add, v1::DecisionCounts* sum);
// The count of kind `d` in `c`: from `by_kind`, else (a daemon older than it) the frozen field.
int64_t CountOf(const v1::DecisionCounts& c, Decision d);
// Adds `n` to the count of kind `d` (by_kind, and the frozen field where the kind has one).
void AddCount(Decision d, int64_t n, v1::DecisionCounts* c);
// Every kind present in `by_kind`, at zero if it had none: what the daemon answers.
void FillKinds(v1::DecisionCounts* c);

}  // namespace shardcoord

#endif  // SHARDCOORD_PROTO_CONVERT_H_
