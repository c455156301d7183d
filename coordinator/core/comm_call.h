// The communicator calls (CommJoin, StoreSet, StoreGet, CommReport; DESIGN 4) and their
// answers, in the core's types. The transport converts each unary RPC at the edge
// (coordinator/server/wire_intake.h) and each answer back; CoordinatorCore and CommTable
// read and give only these. Nothing here is checked yet: the core checks the caller (a live
// rank of the job, calling from its own session, DESIGN 13) and the table the rest (names,
// epochs, bounds, DESIGN 11).
#ifndef SHARDCOORD_COORDINATOR_CORE_COMM_CALL_H_
#define SHARDCOORD_COORDINATOR_CORE_COMM_CALL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace shardcoord::coordinator {

// Who calls: a rank of a job, and the session key its registration was given
// (RegisterResponse.session_key).
struct CommCallerId {
  std::string job_id;
  int rank = -1;
  std::string session_key;
};

// Join communicator `name` (or wait, up to `timeout`, until every member is live).
struct CommJoinCall {
  CommCallerId caller;
  std::string name;
  std::vector<int> ranks;  // Only for custom names: its members, ascending, `caller.rank` among them.
  // Zero or less: the table's default wait (60 s); at most 30 min.
  absl::Duration timeout = absl::ZeroDuration();
};

// What a join answers: the epoch to connect in, its members, and why the previous one ended.
struct CommMembership {
  int64_t epoch = 0;
  std::vector<int> ranks;
  std::string previous_abort_reason;  // Empty unless the previous epoch was aborted.
};

// Publish `value` under `key` in the store of `name`'s epoch `epoch` (once per key).
struct StoreSetCall {
  CommCallerId caller;
  std::string name;
  int64_t epoch = 0;
  std::string key;
  std::string value;
};

// The values of `keys` in the store of `name`'s epoch `epoch`, once all are set (waiting up
// to `timeout`); answered in the order of `keys`.
struct StoreGetCall {
  CommCallerId caller;
  std::string name;
  int64_t epoch = 0;
  std::vector<std::string> keys;
  // Zero or less: the table's default wait (60 s); at most 30 min.
  absl::Duration timeout = absl::ZeroDuration();
};

// What a rank reports of its communicator: connected, or a collective failed. The values are
// the wire's (CommReportRequest.Kind; wire_intake.cc asserts it); any other arrives as it was
// sent, for the table to refuse naming it.
enum class CommReportKind : int32_t { kUnspecified = 0, kReady = 1, kError = 2 };

struct CommReportCall {
  CommCallerId caller;
  std::string name;
  int64_t epoch = 0;
  CommReportKind kind = CommReportKind::kUnspecified;
  std::string error;  // kError: what failed.
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_COMM_CALL_H_
