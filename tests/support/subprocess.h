// Real child processes for multi-process tests: spawn, wait with a deadline, signal.
#ifndef SHARDCOORD_TESTS_SUPPORT_SUBPROCESS_H_
#define SHARDCOORD_TESTS_SUPPORT_SUBPROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace shardcoord::testing {

// A child process. Its stdout and stderr go to files. The destructor kills (SIGKILL) and
// reaps a child that is still running, so a failing test leaves nothing behind.
class Subprocess {
 public:
  // Starts argv[0] with the arguments; `env` entries ("K=V") are added to the environment.
  Subprocess(std::vector<std::string> argv, std::string stdout_path, std::string stderr_path,
             std::vector<std::string> env = {});
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // Waits at most `timeout`; returns the exit code (128 + signal when killed by one), or
  // nullopt when still running.
  std::optional<int> Wait(absl::Duration timeout);
  bool Running();
  void Signal(int sig);
  const std::string& stdout_path() const { return stdout_path_; }
  const std::string& stderr_path() const { return stderr_path_; }

 private:
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::string stdout_path_, stderr_path_;
};

// Runs a command to completion (at most `timeout`), returning exit code and output.
struct RunResult {
  int exit_code = -1;  // -1: timed out (the child was killed).
  std::string out;
  std::string err;
};
RunResult RunCommand(std::vector<std::string> argv, absl::Duration timeout,
              std::vector<std::string> env = {});

}  // namespace shardcoord::testing

#endif  // SHARDCOORD_TESTS_SUPPORT_SUBPROCESS_H_
