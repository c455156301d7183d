// A shardcoordd started for one command: `shardctl replay` without --coordinator plays its ranks
// against a daemon of its own. It runs as a child process (the operator CLI does not link the
// daemon's core), on 127.0.0.1:0, with its log in a private temporary folder, its environment
// cleared of the daemon's own settings (an operator's SHARDCOORD_DAEMON_* must not move it onto a
// shared port or state file), and it dies with this process (PR_SET_PDEATHSIG, which Linux ties
// to the thread that started it: start it from the thread that outlives the replay, the main one).
// A shardctl killed by SIGKILL leaves the temporary folder behind (/tmp/shardctl-replay-*).
#ifndef SHARDCOORD_CLIENT_DAEMON_PROCESS_H_
#define SHARDCOORD_CLIENT_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardcoord::client {

// The shardcoordd to start: `given` when set (--daemon), else $SHARDCOORDD, else the one beside
// this program (as installed by the .deb, CMake and pip), else the first on PATH. NOT_FOUND
// names where it looked and what to do.
absl::StatusOr<std::string> FindDaemon(const std::string& given);

class DaemonProcess {
 public:
  // Starts `binary` and waits until it serves (its address file is written), at most `deadline`.
  // UNAVAILABLE when it exits or does not serve in time, with the tail of its log.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(const std::string& binary, absl::Duration deadline);
  // Stops it: SIGTERM, then SIGKILL after 5 s; removes the temporary folder.
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  const std::string& address() const { return address_; }

 private:
  DaemonProcess(pid_t pid, std::string dir) : pid_(pid), dir_(std::move(dir)) {}
  // Waits until its address file is written; UNAVAILABLE when it exits first or after `deadline`.
  absl::Status AwaitServing(const std::string& binary, absl::Duration deadline);
  // The last lines of its log, for errors.
  std::string LogTail() const;
  // Waits for it to exit, at most `deadline`; true when it has (reaped).
  bool Reap(absl::Duration deadline);

  pid_t pid_;
  std::string dir_;
  std::string address_;
};

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_DAEMON_PROCESS_H_
