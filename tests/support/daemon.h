// A real shardcoordd for multi-process tests, on 127.0.0.1 with a port the OS picks.
#ifndef SHARDCOORD_TESTS_SUPPORT_DAEMON_H_
#define SHARDCOORD_TESTS_SUPPORT_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "support/subprocess.h"

namespace shardcoord::testing {

class Daemon {
 public:
  // Starts SHARDCOORDD_PATH with `flags` added, logs in `dir`, and waits (bounded) until it
  // wrote its address. Fails with the daemon's stderr when it does not come up.
  // `listen` "127.0.0.1:0" picks a port; a restart passes the address of the one it
  // replaces. `name` names its log files (<dir>/<name>.out, .err).
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const std::string& dir,
                                                       const std::vector<std::string>& flags,
                                                       const std::string& listen = "127.0.0.1:0",
                                                       const std::string& name = "daemon");
  const std::string& address() const { return address_; }
  Subprocess& process() { return *process_; }
  std::string Stderr() const;

 private:
  std::unique_ptr<Subprocess> process_;
  std::string address_;
  std::string dir_;
  std::string name_;
};

}  // namespace shardcoord::testing

#endif  // SHARDCOORD_TESTS_SUPPORT_DAEMON_H_
