// The runs a coordinator had live, kept beside its state file (<state file>.runs) so that the
// next start knows which run of each job id it may resume (DESIGN 12).
//
// A resume proves its rank with a credential of the job's run (resume_auth.h). That alone
// would let a process that registered a job id once, in a throwaway run, resume it in any
// later run's place after a restart, before the real ranks come back. So the daemon writes
// the run of every job with a live rank here whenever that set changes (a job created or run
// again, a job ended or forgotten), and after a restart takes a resume only for the run the
// file names for its job. A run not claimed by a resume within the recovery window is
// dropped from the file.
//
// The file: a header line, one line per job ("<run id> <job id in hex>"), a checksum line.
// Written atomically (a temporary file renamed over it), owner-only. At most kMaxRunPinsBytes
// are read: a larger, damaged or missing file means no run is known, so every resume is
// refused with what to do (restart the job), and the daemon says why at start.
#ifndef SHARDCOORD_COORDINATOR_CORE_RUN_PINS_H_
#define SHARDCOORD_COORDINATOR_CORE_RUN_PINS_H_

#include <cstddef>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace shardcoord::coordinator {

// job id -> run id.
using RunPins = std::map<std::string, std::string>;

inline constexpr size_t kMaxRunPinsBytes = size_t{64} << 20;

// The path of the runs file of `state_file` ("" when there is no state file).
std::string RunPinsPath(const std::string& state_file);
// NOT_FOUND when there is no file; DATA_LOSS naming what is wrong when it is not one this
// daemon wrote (header, a line, the checksum, the size).
absl::StatusOr<RunPins> ReadRunPins(const std::string& path);
absl::Status WriteRunPins(const std::string& path, const RunPins& pins);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_RUN_PINS_H_
