#include "shardcoord/proto/convert.h"

#include <optional>

#include <cctype>

#include "absl/strings/str_cat.h"

namespace shardcoord {

static_assert(static_cast<int>(Policy::kReplicate) == v1::POLICY_REPLICATE);
static_assert(static_cast<int>(Fallback::kReplicate) == v1::FALLBACK_REPLICATE);
#define SHARDCOORD_DECISION(e, value, proto, name, colour) \
  static_assert(static_cast<int>(Decision::e) == v1::proto, "decisions.def and shardcoord.v1.Decision disagree");
#include "shardcoord/decisions.def"
#undef SHARDCOORD_DECISION
static_assert(static_cast<int>(Fallback::kPadded) == v1::FALLBACK_PADDED);
static_assert(static_cast<int>(DecisionReason::kPromoted) == v1::REASON_PROMOTED);
static_assert(static_cast<int>(DecisionReason::kCost) == v1::REASON_COST);
static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) ==
              static_cast<int>(grpc::StatusCode::UNAUTHENTICATED));

std::string WireMismatch(uint32_t theirs, const std::string& peer) {
  if (theirs == kWireRevision) return "";
  return absl::StrCat(peer, " speaks wire revision ", theirs,
                      theirs == 0 ? " (built before microbatches were named by a MicrobatchKey)" : "",
                      " and this build ", kWireRevision,
                      "; run workers and coordinator built from the same shardcoord release");
}

void ToProto(const MicrobatchKey& k, v1::MicrobatchKey* out) {
  out->set_step(k.step);
  out->set_microbatch(k.microbatch);
}

MicrobatchKey FromProto(const v1::MicrobatchKey& k) { return {k.step(), k.microbatch()}; }

void ToProto(const ModuleSpec& m, v1::ModuleSpec* out) {
  out->set_name(m.name);
  out->set_param_bytes(m.param_bytes);
  out->set_outside_inner_root(m.outside_inner_root);
  out->set_trainable(m.trainable);
  for (const auto& u : m.units) {
    auto* pu = out->add_units();
    pu->set_name(u.name);
    pu->set_param_bytes(u.param_bytes);
  }
}

ModuleSpec FromProto(const v1::ModuleSpec& m) {
  ModuleSpec out;
  out.name = m.name();
  out.param_bytes = m.param_bytes();
  out.outside_inner_root = m.outside_inner_root();
  out.trainable = m.trainable();
  for (const auto& u : m.units()) out.units.push_back({u.name(), u.param_bytes()});
  return out;
}

void ToProto(const ModuleMemoryUsage& m, v1::ModuleMemory* out) {
  out->set_module(m.module);
  out->set_resident_bytes(m.resident_bytes);
  out->set_peak_bytes(m.peak_bytes);
  out->set_gathered_bytes(m.gathered_bytes);
}

ModuleMemoryUsage FromProto(const v1::ModuleMemory& m) {
  return {m.module(), m.resident_bytes(), m.peak_bytes(), m.gathered_bytes()};
}

void ToProto(const ModuleCost& c, v1::ModuleCostReport* out) {
  out->set_module(c.module);
  out->set_forward_seconds_per_call(c.forward_seconds_per_call);
  for (const UnitCost& u : c.units) {
    v1::UnitCostReport* pu = out->add_units();
    pu->set_unit(u.unit);
    pu->set_gather_bytes(u.gather_bytes);
    pu->set_gather_seconds(u.gather_seconds);
  }
}

ModuleCost FromProto(const v1::ModuleCostReport& c) {
  ModuleCost out;
  out.module = c.module();
  out.forward_seconds_per_call = c.forward_seconds_per_call();
  out.units.reserve(c.units_size());
  for (const auto& u : c.units()) out.units.push_back({u.unit(), u.gather_bytes(), u.gather_seconds()});
  return out;
}

void ToProto(const MicrobatchPlan& p, v1::MicrobatchPlan* out) {
  ToProto(p.key, out->mutable_key());
  for (const auto& [name, calls] : p.calls) (*out->mutable_calls())[name] = calls;
}

MicrobatchPlan FromProto(const v1::MicrobatchPlan& p) {
  MicrobatchPlan out;
  out.key = FromProto(p.key());
  for (const auto& [name, calls] : p.calls()) out.calls[name] = calls;
  return out;
}

void ToProto(const MicrobatchDecision& d, v1::MicrobatchDecision* out) {
  out->set_group(d.group);
  ToProto(d.key, out->mutable_key());
  out->set_seq(d.seq);
  out->set_epoch(d.epoch);
  out->set_digest(d.digest);
  out->set_seal(d.seal);
  for (const auto& m : d.modules) {
    auto* pm = out->add_modules();
    pm->set_module(m.module);
    pm->set_decision(ToProto(m.decision));
    pm->set_reason(ToProto(m.reason));
    pm->set_calls(m.calls);
  }
}

MicrobatchDecision FromProto(const v1::MicrobatchDecision& d) {
  MicrobatchDecision out;
  out.group = d.group();
  out.key = FromProto(d.key());
  out.seq = d.seq();
  out.epoch = d.epoch();
  out.digest = d.digest();
  out.seal = d.seal();
  for (const auto& m : d.modules()) {
    out.modules.push_back({m.module(), FromProto(m.decision()), FromProto(m.reason()), m.calls()});
  }
  return out;
}

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::Status MakeStatus(int code, const std::string& message) {
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

std::string EnumText(std::string name, const std::string& prefix) {
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

std::string StateName(v1::RankState s) { return EnumText(v1::RankState_Name(s), "RANK_STATE_"); }
std::string StateName(v1::GroupState s) { return EnumText(v1::GroupState_Name(s), "GROUP_STATE_"); }
std::string StateName(v1::CommState s) { return EnumText(v1::CommState_Name(s), "COMM_STATE_"); }

bool JobIsOver(const v1::JobStatus& j) {
  return j.ranks_live() == 0 && j.groups_recovering() == 0 && j.ranks_left() + j.ranks_dead() > 0;
}

namespace {

// The frozen fields of DecisionCounts: the five kinds there were when by_kind came. Never
// extended: a later kind is counted in by_kind only.
std::optional<int64_t> FrozenCount(const v1::DecisionCounts& c, Decision d) {
  switch (d) {
    case Decision::kPerLayer: return c.per_layer();
    case Decision::kSkip: return c.skip();
    case Decision::kRoot: return c.root();
    case Decision::kReplicate: return c.replicate();
    case Decision::kPadded: return c.padded();
    default: return std::nullopt;
  }
}

void AddFrozen(Decision d, int64_t n, v1::DecisionCounts* c) {
  switch (d) {
    case Decision::kPerLayer: c->set_per_layer(c->per_layer() + n); break;
    case Decision::kSkip: c->set_skip(c->skip() + n); break;
    case Decision::kRoot: c->set_root(c->root() + n); break;
    case Decision::kReplicate: c->set_replicate(c->replicate() + n); break;
    case Decision::kPadded: c->set_padded(c->padded() + n); break;
    default: break;
  }
}

}  // namespace

int64_t CountOf(const v1::DecisionCounts& c, Decision d) {
  if (auto it = c.by_kind().find(DecisionName(d)); it != c.by_kind().end()) return it->second;
  return FrozenCount(c, d).value_or(0);
}

void AddCount(Decision d, int64_t n, v1::DecisionCounts* c) {
  (*c->mutable_by_kind())[DecisionName(d)] += n;
  AddFrozen(d, n, c);
}

void FillKinds(v1::DecisionCounts* c) {
  for (Decision d : kDecisions) (*c->mutable_by_kind())[DecisionName(d)] += 0;
}

void AddDecisionCounts(const v1::DecisionCounts& add, v1::DecisionCounts* sum) {
  for (Decision d : kDecisions) AddCount(d, CountOf(add, d), sum);
  sum->set_divergent(sum->divergent() + add.divergent());
}

}  // namespace shardcoord
