// Tokens with roles (DESIGN 13). With a token file, every RPC must carry
// `authorization: Bearer <token>` of a role allowed to make it:
//   rank   the session stream (register, plans, heartbeats) and communicator calls;
//   read   the operator queries (status, ranks, groups, decisions, events, comms);
//   admin  everything.
// A token may be limited to one job (`job=ID` on its line): it then registers, opens
// communicators and queries only for that job.
// Without one, every caller is allowed; the daemon then listens only on loopback unless
// started with --insecure (ValidateOptions).
#ifndef SHARDCOORD_COORDINATOR_SERVER_AUTH_H_
#define SHARDCOORD_COORDINATOR_SERVER_AUTH_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/settings/options.h"  // IsLoopbackAddress

namespace shardcoord::coordinator {

enum class Role { kRank, kRead, kAdmin };
const char* RoleName(Role role);

// What a caller's token allows.
struct Grant {
  Role role = Role::kAdmin;
  std::string job;  // Empty: every job.

  // OK, or PERMISSION_DENIED naming the token's job when `job_id` is another.
  absl::Status AllowsJob(const std::string& job_id, const char* method) const;
};

class Tokens {
 public:
  // Lines "ROLE TOKEN [job=ID]" (role rank, read or admin; tokens of at least 16 printable
  // bytes; several per role, for rotation); '#' starts a comment. The file must not be open to others or
  // writable by its group (0600, or 0440 for a Kubernetes Secret with fsGroup). Errors name the file, the line and what to do; tokens are never echoed.
  static absl::StatusOr<Tokens> Load(const std::string& path);
  static Tokens None() { return Tokens(); }

  bool enabled() const { return !tokens_.empty(); }
  // The grant of the caller's token; UNAUTHENTICATED (no bearer token, or not a known one);
  // PERMISSION_DENIED (its role may not make `method`). `authorization` is the header's value
  // ("" when absent). Without tokens, everyone is admin of every job.
  absl::StatusOr<Grant> Check(const std::string& authorization, Role needed, const char* method) const;

 private:
  struct Entry {
    Role role;
    std::string token;
    std::string job;  // Empty: every job.
  };
  std::vector<Entry> tokens_;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SERVER_AUTH_H_
