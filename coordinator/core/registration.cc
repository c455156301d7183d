#include "coordinator/core/registration.h"

#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/engine/text.h"
#include "shardcoord/decide.h"
#include "shardcoord/plan_check.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {

namespace {

absl::Status TooLong(const CoordinatorLimits& lim, const std::string& what, const std::string& value) {
  return absl::InvalidArgumentError(absl::StrCat(
      "register: ", what, " is ", value.size(), " bytes, over the coordinator's max_name_bytes (",
      lim.max_name_bytes, "): '", Printable(value, 32), "'; use a shorter name or raise --max-name-bytes"));
}

absl::Status NoControlCharacters(const std::string& what, const std::string& value) {
  const std::string bad = ControlCharacterIn(value);
  if (bad.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("register: ", what, " '", Printable(value, 64), "' has a control ",
                                                 "character (", bad, "); ids and names must be printable"));
}

// Who is registering: job, host, world and group sizes, rank, memory budget.
absl::Status ValidateIdentity(const Registration& req, const CoordinatorLimits& lim) {
  auto too_long = [&](const std::string& what, const std::string& value) { return TooLong(lim, what, value); };
  if (req.job_id.empty()) {
    return absl::InvalidArgumentError("register: job_id is empty; every rank of a job must "
                                      "send the same non-empty job id");
  }
  if (static_cast<int>(req.job_id.size()) > lim.max_name_bytes) return too_long("job_id", req.job_id);
  if (static_cast<int>(req.host.size()) > lim.max_name_bytes) return too_long("host", req.host);
  if (absl::Status s = NoControlCharacters("job_id", req.job_id); !s.ok()) return s;
  if (absl::Status s = NoControlCharacters("host", req.host); !s.ok()) return s;
  if (req.world_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("register: world_size ", req.world_size,
                                                   " must be >= 1 (job '", req.job_id, "')"));
  }
  if (req.world_size > lim.max_world_size) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: world_size ", req.world_size, " of job '", req.job_id,
        "' is over the coordinator's max_world_size (", lim.max_world_size,
        "); raise --max-world-size if the job really has that many ranks"));
  }
  if (req.group_size <= 0 || req.world_size % req.group_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: group_size ", req.group_size, " must be >= 1 and divide world_size ",
                     req.world_size, " (job '", req.job_id, "', rank ", req.rank, ")"));
  }
  if (req.rank < 0 || req.rank >= req.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("register: unknown rank ", req.rank,
                                                   ": job '", req.job_id, "' has ranks 0..",
                                                   req.world_size - 1));
  }
  if (req.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("register: rank ", req.rank, " sent memory_budget_bytes ",
                                                   req.memory_budget_bytes, "; it must be >= 0 (0: no budget)"));
  }
  return absl::OkStatus();
}

// Far beyond any module (a petabyte): sums of sizes stay exact, and a 2^62-byte unit is refused.
constexpr int64_t kMaxParamBytes = int64_t{1} << 50;

// A module's sizes and its rest unit as DESIGN 5 has them: the rest unit ("") first if at all,
// no unit larger than its module, the units together not larger either.
absl::Status CheckUnitSizes(const ModuleSpec& m) {
  const std::string where = absl::StrCat("register: module '", m.name, "'");
  if (m.param_bytes > kMaxParamBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has param_bytes ", m.param_bytes, ", over 2^50: a manifest "
                                                   "of this size is no real module"));
  }
  int64_t sum = 0;
  for (size_t i = 0; i < m.units.size(); ++i) {
    const LayerUnit& u = m.units[i];
    if (u.name.empty() && i != 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, " lists its rest unit \"\" at position ", i,
                                                     ": the rest unit comes first (the manifest's order, DESIGN 5)"));
    }
    if (u.param_bytes > m.param_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": unit '", u.name, "' has ", u.param_bytes,
                                                     " bytes, more than the module's param_bytes ", m.param_bytes));
    }
    sum += std::max<int64_t>(u.param_bytes, 0);  // Each at most 2^50, a few thousand of them: no overflow.
  }
  if (sum > m.param_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": its units hold ", sum, " bytes together, more than the "
                                                   "module's param_bytes ", m.param_bytes,
                                                   " (a unit counted twice, or the module's size is wrong)"));
  }
  return absl::OkStatus();
}

// The controlled modules and their layer units.
absl::Status ValidateManifest(const Registration& req, const CoordinatorLimits& lim) {
  auto too_long = [&](const std::string& what, const std::string& value) { return TooLong(lim, what, value); };
  if (static_cast<int>(req.modules.size()) > lim.max_modules) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: rank ", req.rank, " lists ", static_cast<int>(req.modules.size()),
        " controlled modules, over the coordinator's max_modules (", lim.max_modules,
        "); control fewer modules or raise --max-modules"));
  }
  std::set<std::string> names;
  for (const ModuleSpec& m : req.modules) {
    if (m.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("register: rank ", req.rank, " sent a module with an empty name"));
    }
    if (static_cast<int>(m.name.size()) > lim.max_name_bytes) return too_long("a module name", m.name);
    if (absl::Status s = NoControlCharacters("a module name", m.name); !s.ok()) return s;
    if (!names.insert(m.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("register: rank ", req.rank,
                                                     " lists module '", m.name, "' twice"));
    }
    if (m.param_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("register: module '", m.name,
                                                     "' has negative param_bytes ",
                                                     m.param_bytes));
    }
    if (static_cast<int64_t>(m.units.size()) > lim.max_units_per_module) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "register: module '", m.name, "' has ", m.units.size(),
          " layer units, over the coordinator's max_units_per_module (", lim.max_units_per_module,
          "); group layers into fewer units or raise --max-units-per-module"));
    }
    if (absl::Status s = CheckUnitSizes(m); !s.ok()) return s;
    std::set<std::string> unit_names;
    for (const LayerUnit& unit : m.units) {
      // "" is the rest unit: the module's parameters that no named unit holds (all of them when
      // it is the only unit). It appears at most once, like every name (checked just below).
      if (!unit_names.insert(unit.name).second) {
        return absl::InvalidArgumentError(absl::StrCat("register: module '", m.name, "' lists layer unit '",
                                                       unit.name, "' twice"));
      }
      if (static_cast<int>(unit.name.size()) > lim.max_name_bytes) return too_long("a unit name", unit.name);
      if (absl::Status s = NoControlCharacters("a unit name", unit.name); !s.ok()) return s;
      if (unit.param_bytes < 0) {
        return absl::InvalidArgumentError(absl::StrCat("register: module '", m.name, "': layer unit '",
                                                       unit.name, "' has negative param_bytes ",
                                                       unit.param_bytes));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRegistration(const Registration& req, const CoordinatorLimits& lim,
                                     int max_lookahead) {
  if (absl::Status s = ValidateIdentity(req, lim); !s.ok()) return s;
  if (absl::Status s = ValidateManifest(req, lim); !s.ok()) return s;
  // One decision names every module and cannot be split: it must fit a worker's message.
  size_t decision_bytes = 64;
  for (const ModuleSpec& m : req.modules) decision_bytes += m.name.size() + 8;
  if (decision_bytes > kMaxDecisionBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: rank ", req.rank, "'s manifest would make each decision about ", decision_bytes,
        " bytes, over the ", kMaxDecisionBytes, " bytes one decision may be; control fewer modules"));
  }
  if (!v1::Policy_IsValid(static_cast<int>(req.policy)) || !v1::Fallback_IsValid(static_cast<int>(req.fallback))) {
    return absl::InvalidArgumentError(absl::StrCat("register: rank ", req.rank,
                                                   " sent an unknown policy or fallback value"));
  }
  if (req.lookahead < 0 || req.lookahead > max_lookahead) {
    return absl::InvalidArgumentError(absl::StrCat(
        "register: lookahead ", req.lookahead, " of rank ", req.rank,
        " is outside 1..", max_lookahead,
        " (the coordinator's --max-lookahead); lower it or raise the coordinator's limit"));
  }
  return absl::OkStatus();
}

Registration WithRegisterDefaults(const Registration& in, const CoordinatorOptions& options) {
  Registration req = in;
  if (req.policy == Policy::kUnspecified) req.policy = options.default_policy;
  if (req.fallback == Fallback::kUnspecified) req.fallback = options.default_fallback;
  if (req.lookahead == 0) req.lookahead = std::min(kDefaultLookahead, options.max_lookahead);
  return req;
}

absl::Status CheckRootIsPossible(const Registration& req) {
  const Policy policy = req.policy;
  const bool uses_root = policy == Policy::kRoot ||
                         ((policy == Policy::kAuto || policy == Policy::kPerLayer) &&
                          req.fallback == Fallback::kRoot);
  if (req.wrap_outer_model) return absl::OkStatus();
  // A trainable module is decided root wherever replicate or padded would be (DecisionEngine).
  std::vector<std::string> outside;
  bool trainable = false;
  for (const ModuleSpec& m : req.modules) {
    if (m.outside_inner_root && (uses_root || m.trainable)) {
      outside.push_back(m.name);
      trainable = trainable || !uses_root;
    }
  }
  if (outside.empty()) return absl::OkStatus();
  if (trainable) {
    return absl::InvalidArgumentError(absl::StrCat(
        "register: root is impossible for rank ", req.rank, ": wrap_outer_model is false and modules [",
        NameList(outside), "] lie outside the inner FSDP root, so no always-run unit can own them, and a "
        "trainable module is decided root when its ranks diverge (replicate and padded are not safe for it). "
        "Ways out: enable wrap_outer_model, or freeze the module"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "register: ", policy == Policy::kRoot ? "policy root" : "fallback root", " is impossible for rank ",
      req.rank, ": wrap_outer_model is false and modules [", NameList(outside),
      "] lie outside the inner FSDP root, so no always-run unit can own them. Ways out: "
      "enable wrap_outer_model, use fallback replicate, or use policy replicate"));
}

absl::Status CheckSameAsReference(const Registration& ref, int ref_rank,
                                  const Registration& req, const std::string& where) {
  if (ref.policy != req.policy) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", req.rank, " registered policy ", PolicyName(req.policy),
        " but rank ", ref_rank, " registered ", PolicyName(ref.policy), where,
        "; every rank of a shard group must use the same policy"));
  }
  if (ref.fallback != req.fallback) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", req.rank, " registered fallback ", FallbackName(req.fallback),
        " but rank ", ref_rank, " registered ", FallbackName(ref.fallback), where,
        "; every rank of a shard group must use the same fallback"));
  }
  if (ref.wrap_outer_model != req.wrap_outer_model) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", req.rank, " registered wrap_outer_model=", req.wrap_outer_model,
        " but rank ", ref_rank, " registered ", ref.wrap_outer_model, where));
  }
  std::string diff = DescribeManifestDifference(ref, ref_rank, req, req.rank);
  if (!diff.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("module manifest mismatch", where, ": ", diff,
                     "; every rank of a shard group must register the same controlled modules"));
  }
  return absl::OkStatus();
}

std::string DescribeManifestDifference(const Registration& a, int rank_a,
                                       const Registration& b, int rank_b) {
  auto names = [](const Registration& r) {
    std::vector<std::string> n;
    for (const ModuleSpec& m : r.modules) n.push_back(m.name);
    return NameList(n);
  };
  if (a.modules.size() != b.modules.size()) {
    return absl::StrCat("rank ", rank_b, " registered modules [", names(b), "] but rank ", rank_a,
                        " registered [", names(a), "]");
  }
  for (size_t i = 0; i < a.modules.size(); ++i) {
    const auto& ma = a.modules[i];
    const auto& mb = b.modules[i];
    if (ma.name != mb.name) {
      return absl::StrCat("rank ", rank_b, " registered modules [", names(b), "] but rank ",
                          rank_a, " registered [", names(a), "] (same order required)");
    }
    if (ma.param_bytes != mb.param_bytes) {
      return absl::StrCat("module '", ma.name, "': param_bytes ", mb.param_bytes, " on rank ",
                          rank_b, " vs ", ma.param_bytes, " on rank ", rank_a);
    }
    if (ma.outside_inner_root != mb.outside_inner_root) {
      return absl::StrCat("module '", ma.name, "': outside_inner_root differs between rank ",
                          rank_b, " and rank ", rank_a);
    }
    if (ma.trainable != mb.trainable) {
      return absl::StrCat("module '", ma.name, "' is ", mb.trainable ? "trainable" : "frozen", " on rank ", rank_b,
                          " but ", ma.trainable ? "trainable" : "frozen", " on rank ", rank_a,
                          " (freeze it, or opt it in as trainable, on every rank alike)");
    }
    if (ma.units.size() != mb.units.size()) {
      return absl::StrCat("module '", ma.name, "': ", mb.units.size(), " layer units on rank ",
                          rank_b, " vs ", ma.units.size(), " on rank ", rank_a);
    }
    for (size_t u = 0; u < ma.units.size(); ++u) {
      if (ma.units[u].name != mb.units[u].name ||
          ma.units[u].param_bytes != mb.units[u].param_bytes) {
        return absl::StrCat("module '", ma.name, "': layer unit ", u, " is '",
                            mb.units[u].name, "' (", mb.units[u].param_bytes,
                            " bytes) on rank ", rank_b, " vs '", ma.units[u].name, "' (",
                            ma.units[u].param_bytes, " bytes) on rank ", rank_a);
      }
    }
  }
  return "";
}

uint64_t DecisionConfigDigest(const CoordinatorOptions& options) {
  const std::string text = absl::StrCat("promote_window=", options.promotion.window,
                                        " promote_threshold=", options.promotion.promote_threshold,
                                        " demote_threshold=", options.promotion.demote_threshold,
                                        options.promotion.by_cost ? "" : " auto_by_cost=false");
  return Fnv1a(text);
}

absl::Status CheckResume(const Registration& req, uint64_t incarnation, uint64_t config_digest) {
  const v1::ResumeState& r = *req.resume;
  if (r.incarnation() >= incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "register: rank ", req.rank, " of job '", req.job_id, "' resumes from coordinator incarnation ",
        r.incarnation(), ", which is not older than this coordinator's (", incarnation,
        "): the clock of this host stepped back; start shardcoordd with --state-file so incarnations keep "
        "increasing, or restart the job"));
  }
  const v1::RegisterResponse& prev = r.previous();
  std::vector<std::string> diffs;
  const int group = req.group_size > 0 ? req.rank / req.group_size : 0;
  if (prev.group() != group) diffs.push_back(absl::StrCat("group ", prev.group(), " -> ", group));
  if (FromProto(prev.policy()) != req.policy) {
    diffs.push_back(absl::StrCat("policy ", PolicyName(FromProto(prev.policy())), " -> ",
                                 PolicyName(req.policy)));
  }
  if (FromProto(prev.fallback()) != req.fallback) {
    diffs.push_back(absl::StrCat("fallback ", FallbackName(FromProto(prev.fallback())), " -> ",
                                 FallbackName(req.fallback)));
  }
  if (prev.lookahead() != req.lookahead) {
    diffs.push_back(absl::StrCat("lookahead ", prev.lookahead(), " -> ", req.lookahead));
  }
  if (prev.config_digest() != config_digest) diffs.push_back("auto promotion settings (promote/demote window and thresholds)");
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "register: rank ", req.rank, " of job '", req.job_id, "' cannot resume: the coordinator restarted with "
      "settings that change its decisions (", absl::StrJoin(diffs, "; "), "); restart shardcoordd with the settings "
      "the job started under, or restart the job"));
}

namespace {

constexpr int64_t kMaxResumeEpoch = int64_t{1} << 40;  // Re-forms: far beyond any job's.
constexpr uint64_t kMaxResumeSeq = uint64_t{1} << 62;

// Why `d` is no decision this rank's group could have received ("" when it could be).
std::string ImpossibleDecision(const Registration& req, const v1::MicrobatchDecision& d) {
  const int group = req.rank / req.group_size;
  if (d.group() != group) return absl::StrCat("it is for group ", d.group(), ", the rank is in group ", group);
  if (d.epoch() != req.resume->group_epoch()) {
    // Only the epoch being recovered: a decision of an earlier epoch was made for a group that
    // has re-formed since, and is no evidence of what the group holds now.
    return absl::StrCat("its epoch ", d.epoch(), " is not ", req.resume->group_epoch(),
                        ", the epoch the rank resumes at (a resume holds decisions of that epoch only)");
  }
  if (!d.has_key()) return "it names no microbatch (no key)";
  if (d.key().step() < 0 || d.key().microbatch() < 0) return "its step or microbatch is negative";
  if (d.seq() >= kMaxResumeSeq) return absl::StrCat("its seq ", d.seq(), " is beyond 2^62");
  if (static_cast<size_t>(d.modules_size()) != req.modules.size()) {
    return absl::StrCat("it has ", d.modules_size(), " module entries, the manifest ", req.modules.size());
  }
  for (int i = 0; i < d.modules_size(); ++i) {
    const auto& m = d.modules(i);
    if (m.module() != req.modules[i].name) {
      return absl::StrCat("entry ", i, " names module '", Printable(m.module(), 64), "', the manifest '",
                          req.modules[i].name, "'");
    }
    if (!KnownDecision(m.decision()) || !v1::DecisionReason_IsValid(m.reason()) ||
        m.reason() == v1::REASON_UNSPECIFIED) {
      return absl::StrCat("module '", m.module(), "' has decision ", static_cast<int>(m.decision()), " and reason ",
                          static_cast<int>(m.reason()), ", which the protocol does not define");
    }
    if (!PassesFit(FromProto(m.decision()), m.calls())) {
      return absl::StrCat("module '", m.module(), "' has decision ", v1::Decision_Name(m.decision()), " with ",
                          m.calls(), " passes (a padded decision has 1 to ", kMaxCallsPerModule, ", every other none)");
    }
  }
  if (d.digest() != DecisionDigest(FromProto(d))) return "its digest does not match its fields";
  return "";
}

}  // namespace

absl::Status CheckResumeTrust(const Registration& req, const ResumeAuthority& auth, bool* verified) {
  const v1::ResumeState& r = *req.resume;
  const std::string who = absl::StrCat("register: the resume of rank ", req.rank, " of job '", req.job_id, "'");
  if (r.group_epoch() < 0 || r.group_epoch() > kMaxResumeEpoch) {
    return absl::InvalidArgumentError(absl::StrCat(who, " claims group epoch ", r.group_epoch(), ", outside 0..2^40"));
  }
  for (const auto& d : r.held()) {
    if (std::string why = ImpossibleDecision(req, d); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(who, " holds a decision for ", KeyOf(d).ToString(),
                                                     " that its group could not have received: ", why));
    }
  }
  for (const auto& p : r.undecided()) {
    if (!p.has_key()) {
      return absl::InvalidArgumentError(absl::StrCat(who, " holds an undecided plan without a key (MicrobatchPlan.key): "
                                                     "every plan names its microbatch; register afresh"));
    }
  }
  const std::string& run = r.previous().run_id();
  if (!ResumeAuthority::IsRunId(run)) {
    *verified = false;
    if (!auth.persistent()) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        who, " names no run of the job (ResumeState.previous.run_id: 32 hex characters): it comes from a worker older "
        "than this coordinator, or was made up; restart the job"));
  }
  const ResumeAuthority run_auth = auth.ForRun(req.job_id, run);
  *verified = run_auth.CheckCredential(req.job_id, req.rank, r.incarnation(), r.previous().registration(), r.credential());
  if (!*verified) {
    if (!auth.persistent()) return absl::OkStatus();  // Nothing to check against (see resume_auth.h).
    return absl::PermissionDeniedError(absl::StrCat(
        who, " carries no valid resume credential for run ", run, ": only the process this coordinator (or an earlier "
        "one with the same resume key) registered as that rank in that run may resume it; a rank that never registered "
        "registers afresh, without a resume. If the daemon's resume key changed (a new --state-file, or edited "
        "tokens), restart the job"));
  }
  for (const auto& d : r.held()) {
    if (!run_auth.CheckSeal(req.job_id, d)) {
      return absl::PermissionDeniedError(absl::StrCat(
          who, " holds a decision for ", KeyOf(d).ToString(), " seq ", d.seq(),
          " that no coordinator with this resume key made (its seal does not verify): the resume is refused whole"));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardcoord::coordinator
