// The daemon's optional state file (DESIGN 12): the incarnation of the last start, so the
// next one is larger even if the clock stepped back. Never needed for correctness: without
// it (or when it is corrupt, unreadable or stale) the incarnation is the start time in
// microseconds, and a warning says why the file was ignored.
#ifndef SHARDCOORD_COORDINATOR_DAEMON_STATE_FILE_H_
#define SHARDCOORD_COORDINATOR_DAEMON_STATE_FILE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardcoord::coordinator {

// The incarnation stored in `path`: NOT_FOUND when there is no file, DATA_LOSS when it is
// not one this daemon wrote (bad header, bad number, checksum mismatch).
absl::StatusOr<uint64_t> ReadIncarnation(const std::string& path);
// Writes atomically (a temporary file renamed over `path`).
absl::Status WriteIncarnation(const std::string& path, uint64_t incarnation);

// This start's incarnation: max(now in unix microseconds, stored + 1). With a path, reads
// it (ignoring a bad file with a warning) and writes the new one back (warning on failure).
uint64_t NextIncarnation(const std::string& path, absl::Time now);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_DAEMON_STATE_FILE_H_
