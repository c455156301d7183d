#include "daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

extern char** environ;

namespace shardcoord::client {
namespace {

bool Executable(const std::string& path) {
  struct stat st;
  return !path.empty() && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// The folder of this program, from /proc/self/exe ("" when unknown).
std::string OwnFolder() {
  std::vector<char> buf(4096);
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return "";
  std::string path(buf.data(), static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

// The daemon's own settings in the environment: SHARDCOORD_DAEMON_*, and the names from before
// that scheme (shardcoordd's kRenamedEnv).
bool DaemonSetting(absl::string_view entry) {
  return absl::StartsWith(entry, "SHARDCOORD_DAEMON_") || absl::StartsWith(entry, "SHARDCOORDD_") ||
         absl::StartsWith(entry, "SHARDCOORD_LISTEN=") || absl::StartsWith(entry, "SHARDCOORD_HTTP_LISTEN=");
}

// "<what><errno>\n" on `fd`, between fork and exec (async-signal-safe: no allocation, no locale).
void WriteErrno(int fd, const char* what, int error) {
  char buf[96];
  size_t n = 0;
  for (const char* p = what; *p != '\0' && n < sizeof(buf) - 12; ++p) buf[n++] = *p;
  char digits[12];
  size_t k = 0;
  unsigned value = error < 0 ? 0u : static_cast<unsigned>(error);
  do {
    digits[k++] = static_cast<char>('0' + value % 10);
    value /= 10;
  } while (value != 0 && k < sizeof(digits));
  while (k > 0) buf[n++] = digits[--k];
  buf[n++] = '\n';
  [[maybe_unused]] const ssize_t written = ::write(fd, buf, n);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

absl::StatusOr<std::string> FindDaemon(const std::string& given) {
  if (!given.empty()) {
    if (Executable(given)) return given;
    return absl::NotFoundError(absl::StrCat("--daemon ", given, " is not an executable file"));
  }
  if (const char* env = std::getenv("SHARDCOORDD"); env != nullptr && *env != '\0') {
    if (Executable(env)) return std::string(env);
    return absl::NotFoundError(absl::StrCat("$SHARDCOORDD (", env, ") is not an executable file"));
  }
  const std::string own = OwnFolder();
  // Beside this program (installed), or in a CMake build tree (client/ and coordinator/).
  for (const std::string& candidate : {own + "/shardcoordd", own + "/../coordinator/shardcoordd"}) {
    if (!own.empty() && Executable(candidate)) return candidate;
  }
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "", ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(dir, "/shardcoordd");
    if (Executable(candidate)) return candidate;
  }
  return absl::NotFoundError(absl::StrCat(
      "no shardcoordd to start for the replay (looked beside this program in '", own, "', and on PATH): install it "
      "with shardctl, pass its path with --daemon or $SHARDCOORDD, or give a running one with --coordinator"));
}

namespace {

// The child, between fork and exec (async-signal-safe calls only): dies with its parent, its
// output into `log`, nothing else of shardctl's open, then the daemon.
[[noreturn]] void ExecDaemon(pid_t parent, const char* log, const char* binary, char* const argv[],
                             char* const envp[]) {
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) ::_exit(127);  // The parent is already gone.
  const int fd = ::open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  const int null = ::open("/dev/null", O_RDONLY);
  if (fd < 0 || null < 0) ::_exit(126);  // Never onto shardctl's own output.
  ::dup2(fd, STDOUT_FILENO);
  ::dup2(fd, STDERR_FILENO);
  ::dup2(null, STDIN_FILENO);
  ::close_range(3, ~0U, 0);  // Nothing else of shardctl's (its --output file, its sockets).
  ::execve(binary, argv, envp);
  WriteErrno(STDERR_FILENO, "cannot execute it: errno ", errno);
  ::_exit(127);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(const std::string& binary,
                                                                   absl::Duration deadline) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir_template = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/shardctl-replay-XXXXXX");
  if (::mkdtemp(dir_template.data()) == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot make a temporary folder (", dir_template,
                                               ") for the replay's shardcoordd: ", std::strerror(errno),
                                               "; set TMPDIR to a writable folder"));
  }
  const std::string dir = dir_template;
  const std::string log = dir + "/shardcoordd.log", addr = dir + "/address";
  // Everything the child needs is made before fork: between fork and exec only async-signal-safe calls.
  std::vector<std::string> args = {binary, "--listen", "127.0.0.1:0", "--address-file", addr};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!DaemonSetting(*e)) envp.push_back(*e);
  }
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::rmdir(dir.c_str());
    return absl::UnavailableError(absl::StrCat("cannot start shardcoordd for the replay: fork: ", std::strerror(errno)));
  }
  if (pid == 0) ExecDaemon(parent, log.c_str(), binary.c_str(), argv.data(), envp.data());
  std::unique_ptr<DaemonProcess> d(new DaemonProcess(pid, dir));
  if (absl::Status s = d->AwaitServing(binary, deadline); !s.ok()) return s;
  return d;
}

absl::Status DaemonProcess::AwaitServing(const std::string& binary, absl::Duration deadline) {
  const absl::Time until = absl::Now() + deadline;
  while (absl::Now() < until) {
    std::string address(absl::StripAsciiWhitespace(ReadAll(dir_ + "/address")));
    if (!address.empty()) {
      address_ = address;
      return absl::OkStatus();
    }
    int status = 0;
    const pid_t waited = ::waitpid(pid_, &status, WNOHANG);
    if (waited < 0 && errno == ECHILD) {  // SIGCHLD ignored: reaped already, its status lost.
      pid_ = -1;
      return absl::UnavailableError(absl::StrCat("the replay's shardcoordd (", binary, ") exited before serving: ",
                                                 LogTail()));
    }
    if (waited == pid_) {
      pid_ = -1;
      return absl::UnavailableError(absl::StrCat("the replay's shardcoordd (", binary, ") exited with ",
                                                 WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status),
                                                 " before serving: ", LogTail()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::UnavailableError(absl::StrCat("the replay's shardcoordd (", binary, ") did not serve within ",
                                             absl::FormatDuration(deadline), ": ", LogTail()));
}

std::string DaemonProcess::LogTail() const {
  std::vector<std::string> lines = absl::StrSplit(ReadAll(dir_ + "/shardcoordd.log"), '\n', absl::SkipEmpty());
  if (lines.empty()) return "(its log is empty)";
  if (lines.size() > 5) lines.erase(lines.begin(), lines.end() - 5);
  std::string out;
  for (const auto& line : lines) absl::StrAppend(&out, out.empty() ? "" : " | ", line);
  return out;
}

bool DaemonProcess::Reap(absl::Duration deadline) {
  const absl::Time until = absl::Now() + deadline;
  do {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (absl::Now() < until);
  return false;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    if (!Reap(absl::Seconds(5))) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  for (const char* name : {"/address", "/address.tmp", "/shardcoordd.log"}) ::unlink((dir_ + name).c_str());
  ::rmdir(dir_.c_str());
}

}  // namespace shardcoord::client
