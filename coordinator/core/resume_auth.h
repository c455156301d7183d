// Who may resume a rank, and which held decisions a resume may carry (DESIGN 12, 13).
//
// After a restart a rank resumes with what it held: the decisions it received. Those are
// binding for its whole group, so a client that could send a resume for a rank it does not
// run, or decisions the coordinator never made, could hand honest ranks a decision that hangs
// NCCL. So every registration answer carries a resume credential for that registration of
// (job, rank): the coordinator process and the serial of the answer are in it; and every
// decision a seal, both keyed MACs (HMAC-SHA256, truncated to 128 bits) under a key of the
// job's run (ForRun: derived from the daemon's resume key, the job id and the run id, new
// each time the job id starts afresh). A resume is taken only with the credential of its rank
// in the run being resumed and held decisions only with their seals: whatever a client makes
// up, or kept from an earlier run of the same job id, fails the check.
//
// The key must outlive the process for resumes after a restart to verify. It comes from, in
// this order: the key file next to --state-file (<state file>.key, 32 random bytes written at
// the first start, mode 0600); the token file (a digest of its contents: the same tokens, the
// same key); else a key of this process only. With the last, a resume from an earlier
// incarnation cannot be checked: it is taken unverified (the loopback development mode, where
// every local process is trusted anyway), which an event and the log say. Thread-safe (const).
#ifndef SHARDCOORD_COORDINATOR_CORE_RESUME_AUTH_H_
#define SHARDCOORD_COORDINATOR_CORE_RESUME_AUTH_H_

#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "shardcoord/v1/coordinator.pb.h"

namespace shardcoord::coordinator {

class ResumeAuthority {
 public:
  // `key`: at least 16 bytes; `persistent`: whether a restarted daemon has the same key.
  ResumeAuthority(std::string key, bool persistent);
  // A key of this process only (random).
  static ResumeAuthority Ephemeral();

  bool persistent() const { return persistent_; }
  // The authority of one run of `job` (RegisterResponse.run_id): its key is derived from this
  // key, the job id and the run, so credentials and seals of one run verify in no other.
  ResumeAuthority ForRun(const std::string& job, const std::string& run) const;
  // A new run id: 32 hex characters of 128 random bits.
  static std::string NewRunId();
  // Whether `run` has the form NewRunId gives.
  static bool IsRunId(const std::string& run);
  // The credential of one registration of (job, rank): the `serial`-th registration answered
  // by the coordinator process `incarnation` (RegisterResponse.incarnation, .registration).
  // 32 hex characters. A resume proves which registration it is; of two that prove one rank,
  // the newer holds the slot (DESIGN 12).
  std::string Credential(const std::string& job, int rank, uint64_t incarnation, uint64_t serial) const;
  bool CheckCredential(const std::string& job, int rank, uint64_t incarnation, uint64_t serial,
                       const std::string& credential) const;
  // The seal of a decision of `job`: over every field but `seal` and `decided_unix_ms`.
  std::string Seal(const std::string& job, const v1::MicrobatchDecision& d) const;
  bool CheckSeal(const std::string& job, const v1::MicrobatchDecision& d) const;

 private:
  // HMAC-SHA256 of `message` under the key, truncated to 128 bits.
  std::string Mac(const std::string& message) const;
  // The key's two HMAC pads, each already hashed (a SHA-256 state after its 64-byte block),
  // made once: a seal, on every decision, then costs copying those states and hashing the
  // message, not OpenSSL's HMAC() setting up (and looking up the digest) per call. Shared
  // between copies; read-only once made.
  struct Pads;
  static std::shared_ptr<const Pads> MakePads(const std::string& key);
  std::shared_ptr<const Pads> pads_;
  bool persistent_;
};

// The daemon's resume key, as the comment above says. NOT_FOUND when neither file is set;
// an error naming the file when it cannot be read or created.
struct ResumeKey {
  std::string key;
  std::string source;  // For the start-up log line: which file it came from.
};
absl::StatusOr<ResumeKey> LoadResumeKey(const std::string& state_file, const std::string& token_file);

// The token file (`st`: its stat) is a regular file of at most kMaxTokenFileBytes, else
// INVALID_ARGUMENT naming it: /dev/zero or a FIFO would be read forever. Checked by both of its
// readers, LoadResumeKey and the token table (server/auth.h).
inline constexpr int64_t kMaxTokenFileBytes = 1 << 20;
absl::Status CheckTokenFileShape(const std::string& path, const struct stat& st);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_RESUME_AUTH_H_
