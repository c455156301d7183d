// What a start of the daemon needs beyond valid settings (`shardcoordd --check-config`).
#ifndef SHARDCOORD_COORDINATOR_DAEMON_SERVING_CHECK_H_
#define SHARDCOORD_COORDINATOR_DAEMON_SERVING_CHECK_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/settings/options.h"

namespace shardcoord::coordinator {

// What serving needs beyond valid settings, checked without serving (`shardcoordd
// --check-config`), so that a clean result means the daemon will start: the TLS files and
// the token file usable, the TLS copy's temporary folder writable, the journal, state, resume
// key and address files writable or creatable, and the gRPC and HTTP addresses free (each
// bound and listened on, then released). One entry per problem, naming the file or address
// and what to do; empty: the daemon will start.
std::vector<std::string> CheckServingNeeds(const CoordinatorOptions& options);

// Whether the daemon can write `path` (a file it opens or replaces at start): its folder
// exists and takes new files, and the file, if present, opens for writing (unless
// `replaced`: written whole elsewhere and renamed over it, which needs the folder only).
// `what` names it ("journal file") and `flag` says how to give another. OK when writable.
absl::Status CheckWritableFile(const std::string& what, const std::string& flag, const std::string& path,
                               bool replaced = false);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_DAEMON_SERVING_CHECK_H_
