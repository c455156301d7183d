// A rank's registration in the core's types, and its checks (DESIGN 3, "Registration"): pure
// functions of the registration, the limits and the group's first registration.
// CoordinatorCore::Register runs the ones that need no state (the wire revision first,
// WireMismatch in proto/convert.h, then ValidateRegistration, CheckRootIsPossible,
// CheckResume, CheckResumeTrust) before it takes its lock, and CheckSameAsReference under it.
#ifndef SHARDCOORD_COORDINATOR_CORE_REGISTRATION_H_
#define SHARDCOORD_COORDINATOR_CORE_REGISTRATION_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/settings/options.h"
#include "shardcoord/types.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

// A rank's registration (the wire's RegisterRequest, converted by the transport:
// server/wire_intake.h), in the core's types. Nothing in it is checked yet: Register checks it
// with ValidateRegistration before anything else reads it.
struct Registration {
  std::string job_id;
  int rank = 0;
  int world_size = 0;
  int group_size = 0;
  std::vector<ModuleSpec> modules;  // The controlled modules, in the order the rank runs them.
  // As sent: the conversion keeps a value the protocol does not define, for the check to name.
  Policy policy = Policy::kUnspecified;
  Fallback fallback = Fallback::kUnspecified;
  bool wrap_outer_model = false;
  int lookahead = 0;  // 0: the coordinator's default.
  int64_t memory_budget_bytes = 0;
  std::string host;  // For status only.
  int64_t pid = 0;   // For status only.
  uint32_t wire_revision = 0;
  // A rank resuming after a coordinator restart: what it held, in wire form, because that is
  // the form the daemon sealed (its credential and each held decision's seal are checked
  // against those fields: DESIGN 12, 13) and the form the group's recovery replays.
  std::optional<v1::ResumeState> resume;
};

// Largest one decision may be (it lists every module, and a message holds at least one);
// workers (worker_impl.h, kWorkerMaxReceiveBytes) and shardctl accept messages of 64 MiB.
inline constexpr size_t kMaxDecisionBytes = 1 << 20;

// The request on its own: names, sizes, ranks, the manifest's shape, policy values, the
// lookahead. INVALID_ARGUMENT or RESOURCE_EXHAUSTED (a limit, named with its flag).
absl::Status ValidateRegistration(const Registration& req, const CoordinatorLimits& lim,
                                     int max_lookahead);

// A rank's request against the first registration of its group (`ref`, from `ref_rank`):
// same policy, fallback, wrap_outer_model and manifest. FAILED_PRECONDITION naming both
// ranks and the first difference; `where` says which job and group.
absl::Status CheckSameAsReference(const Registration& ref, int ref_rank,
                                  const Registration& req, const std::string& where);

// The request with the coordinator's defaults filled in (policy, fallback, lookahead).
Registration WithRegisterDefaults(const Registration& in, const CoordinatorOptions& options);

// `root` (policy or fallback) needs an always-run unit to own the controlled modules: with
// wrap_outer_model false, modules outside the inner root make it impossible. INVALID_ARGUMENT
// naming them and the ways out.
absl::Status CheckRootIsPossible(const Registration& req);

// The first difference between two manifests, or "" when they are the same.
std::string DescribeManifestDifference(const Registration& a, int rank_a,
                                       const Registration& b, int rank_b);

// Digest of the coordinator settings that change decisions beyond the registration's own
// (auto promotion), sent in RegisterResponse.config_digest.
uint64_t DecisionConfigDigest(const CoordinatorOptions& options);

// A rank resuming after a coordinator restart (`req` with defaults filled in, so its
// effective policy is this coordinator's): its previous coordinator must be an older
// incarnation, and what it registered under (group, policy, fallback, lookahead, the
// decision settings) must be what this coordinator gives. FAILED_PRECONDITION naming every
// difference and what to do.
absl::Status CheckResume(const Registration& req, uint64_t incarnation, uint64_t config_digest);

// Whether a resume may be believed (DESIGN 12, resume_auth.h). Every field is range-checked
// and every held decision must be one the group could have been given: its group and epoch,
// one entry per module of `req`'s manifest in order, decisions and reasons the protocol
// defines, seq below 2^62, the digest of its fields (INVALID_ARGUMENT naming the decision).
// Held decisions are of the epoch the rank resumes at only. Then the resume must name a run
// (previous.run_id), the credential must be the one issued for (job, rank) in that run and
// each held decision's seal must verify with the run's key (PERMISSION_DENIED naming what
// failed), unless `auth` has no key that outlives its process: then *verified is false and
// the resume is taken as sent. Whether the run named is the job's current one needs the
// core's state (CoordinatorCore::CheckResumedRun).
absl::Status CheckResumeTrust(const Registration& req, const ResumeAuthority& auth, bool* verified);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_REGISTRATION_H_
