#include "support/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "absl/time/clock.h"
#include "support/test_env.h"

extern char** environ;

namespace shardcoord::testing {

Subprocess::Subprocess(std::vector<std::string> argv, std::string stdout_path,
                       std::string stderr_path, std::vector<std::string> env)
    : stdout_path_(std::move(stdout_path)), stderr_path_(std::move(stderr_path)) {
  // `env` replaces what the environment has of the same name: getenv and the sanitizers take a
  // name's first entry, the loader its last, so an entry added beside an inherited one is ignored
  // by some readers.
  const auto name_of = [](const std::string& entry) { return entry.substr(0, entry.find('=') + 1); };
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    bool replaced = false;
    for (const auto& mine : env) replaced = replaced || name_of(mine) == name_of(entry);
    if (!replaced) envs.push_back(entry);
  }
  for (auto& e : env) envs.push_back(e);
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  for (auto& e : envs) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    int out = open(stdout_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = open(stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out >= 0) dup2(out, 1);
    if (err >= 0) dup2(err, 2);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    // Die with the test runner, so no child outlives a crashed test.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    execve(cargv[0], cargv.data(), cenv.data());
    _exit(127);
  }
}

Subprocess::~Subprocess() {
  if (!exit_code_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    Wait(absl::Seconds(10));
  }
}

std::optional<int> Subprocess::Wait(absl::Duration timeout) {
  if (exit_code_) return exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

bool Subprocess::Running() { return !Wait(absl::ZeroDuration()).has_value(); }

void Subprocess::Signal(int sig) {
  if (!exit_code_ && pid_ > 0) kill(pid_, sig);
}

RunResult RunCommand(std::vector<std::string> argv, absl::Duration timeout, std::vector<std::string> env) {
  TempDir dir;
  RunResult result;
  {
    Subprocess p(std::move(argv), dir.File("out"), dir.File("err"), std::move(env));
    auto code = p.Wait(timeout);
    result.exit_code = code ? *code : -1;
  }
  result.out = ReadFile(dir.File("out"));
  result.err = ReadFile(dir.File("err"));
  return result;
}

}  // namespace shardcoord::testing
