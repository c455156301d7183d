#include "coordinator/daemon/serving_check.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/server/auth.h"
#include "coordinator/server/tls.h"

namespace shardcoord::coordinator {

namespace {

std::string FolderOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// 0 when a new file can be made in `dir` (one is created and removed: access() says yes to
// root for any folder, and knows nothing of what a file system refuses); else the errno.
int CreateErrorIn(const std::string& dir) {
  std::string probe = absl::StrCat(dir, "/.shardcoordd-check-XXXXXX");
  const int fd = mkstemp(probe.data());
  if (fd < 0) return errno;
  ::close(fd);
  ::unlink(probe.c_str());
  return 0;
}

// The journal opens read-write in place (SQLite, with its -wal and -shm files beside it).
absl::Status CheckJournalFile(const std::string& path) {
  if (absl::Status s = CheckWritableFile("journal file", "--journal-file", path); !s.ok()) return s;
  const int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::OkStatus();  // Created at start, in a folder that takes files.
    return absl::FailedPreconditionError(absl::StrCat("journal file ", path, " cannot be opened for reading and writing (",
                                                      std::strerror(errno),
                                                      "); make it writable by the daemon's user or give another "
                                                      "--journal-file"));
  }
  char header[16] = {};
  const ssize_t n = ::read(fd, header, sizeof header);
  ::close(fd);
  // An empty file becomes a new journal; anything else must be an SQLite database.
  if (n != 0 && (n != static_cast<ssize_t>(sizeof header) || std::memcmp(header, "SQLite format 3", 16) != 0)) {
    return absl::FailedPreconditionError(absl::StrCat("journal file ", path,
                                                      " is not an SQLite file (so not a shardcoord journal): "
                                                      "move it away or give another --journal-file"));
  }
  return absl::OkStatus();
}

// The state file is replaced by a rename; its resume key, <state file>.key, is created
// beside it at the first start and must hold a key at every later one.
absl::Status CheckStateFile(const std::string& path) {
  if (absl::Status s = CheckWritableFile("state file", "--state-file", path, /*replaced=*/true); !s.ok()) return s;
  struct stat st {};
  if (::stat((path + ".key").c_str(), &st) != 0) return absl::OkStatus();
  return LoadResumeKey(path, "").status();
}

// gRPC serves TLS from a private copy of the certificate files under $TMPDIR (tls.h).
absl::Status CheckTlsCopyFolder() {
  const char* tmpdir = std::getenv("TMPDIR");
  const std::string parent = tmpdir != nullptr && *tmpdir != 0 ? tmpdir : "/tmp";
  if (const int err = CreateErrorIn(parent); err != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "TLS: the daemon serves from a private copy of the certificate files under ", parent,
        " ($TMPDIR, else /tmp), which does not take new files (", std::strerror(err),
        "); set TMPDIR to a writable folder (Kubernetes: an emptyDir volume at /tmp)"));
  }
  return absl::OkStatus();
}

// 0 when a socket bound to `a` listens (as the server's will: SO_REUSEADDR, no SO_REUSEPORT);
// the socket then stays open in `held`. Else the errno. `v6only`: an IPv6 socket takes IPv6
// only (when the IPv4 address is probed by a socket of its own); otherwise it is dual-stack,
// as gRPC binds [::], so an IPv4 listener on the port is found too.
int BindAndListen(const addrinfo& a, bool v6only, std::vector<int>& held) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_CLOEXEC, a.ai_protocol);
  if (fd < 0) return errno;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const int v6 = v6only ? 1 : 0;
  if (a.ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6, sizeof v6);
  if (::bind(fd, a.ai_addr, a.ai_addrlen) != 0 || ::listen(fd, 1) != 0) {
    const int err = errno;
    ::close(fd);
    return err;
  }
  held.push_back(fd);
  return 0;
}

struct Listener {
  std::string setting;  // "listen" or "http_listen"
  std::string flag;     // "--listen" or "--http-listen"
  std::string address;  // HOST:PORT as configured
  std::string host, port;
};

std::string ListenProblem(const Listener& l, int err, const std::string& taken_by) {
  const std::string head = absl::StrCat(l.setting, " ", l.address, ": ");
  const std::string other = absl::StrCat(" with ", l.flag, " HOST:PORT (port 0 picks a free one)");
  if (err == EADDRINUSE && !taken_by.empty()) {
    return absl::StrCat(head, "port ", l.port, " is the port of ", taken_by, "; give them different ports", other);
  }
  if (err == EADDRINUSE) {
    return absl::StrCat(head, "port ", l.port, " is already in use (another shardcoordd or program: `ss -ltnp 'sport = :",
                        l.port, "'` names it); stop it or give another port", other);
  }
  if (err == EADDRNOTAVAIL) {
    return absl::StrCat(head, l.host, " is not an address of this host; give one of its addresses, or 0.0.0.0 for all,",
                        other);
  }
  if (err == EACCES) {
    return absl::StrCat(head, "port ", l.port, " is below 1024 and needs a privilege (CAP_NET_BIND_SERVICE) the daemon ",
                        "lacks; give a port from 1024 up", other);
  }
  return absl::StrCat(head, "cannot listen (", std::strerror(err), "); give another address", other);
}

// Binds and listens on every address `l` resolves to, keeping the sockets in `held` so that
// the next listener is checked against this one too. `taken_by` names the earlier listener
// whose port this one shares, if any.
absl::Status ProbeListener(const Listener& l, bool ip_only, const std::string& taken_by, std::vector<int>& held) {
  int port = -1;
  if (!absl::SimpleAtoi(l.port, &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(l.setting, " '", l.address,
                                                   "' must be HOST:PORT with a port in 0..65535; fix ", l.flag));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV | (ip_only ? AI_NUMERICHOST : 0);
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(l.host.empty() ? nullptr : l.host.c_str(), l.port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        l.setting, " ", l.address, ": '", l.host, "' ",
        ip_only ? "is not an IP address (or localhost)" : absl::StrCat("cannot be resolved (", gai_strerror(rc), ")"),
        "; give an address of this host, or 0.0.0.0 for all, with ", l.flag));
  }
  bool has_v4 = false;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) has_v4 = has_v4 || a->ai_family == AF_INET;
  int bound = 0;
  int error = 0;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int err = BindAndListen(*a, /*v6only=*/has_v4, held);
    if (err == 0) ++bound;
    if (err != 0 && (error == 0 || err == EADDRINUSE)) error = err;
  }
  ::freeaddrinfo(found);
  // One family missing (no IPv6 here) is fine, as it is to gRPC; a port in use is not.
  if (bound > 0 && error != EADDRINUSE) return absl::OkStatus();
  return absl::UnavailableError(ListenProblem(l, error, taken_by));
}

Listener SplitListener(const std::string& setting, const std::string& flag, const std::string& address, bool ip_only) {
  Listener l{setting, flag, address, "", ""};
  const size_t colon = address.rfind(':');
  l.host = colon == std::string::npos ? address : address.substr(0, colon);
  l.port = colon == std::string::npos ? "" : address.substr(colon + 1);
  if (l.host.size() >= 2 && l.host.front() == '[' && l.host.back() == ']') l.host = l.host.substr(1, l.host.size() - 2);
  // The HTTP listener's own reading (http_server.cc): localhost is 127.0.0.1, no host is 0.0.0.0.
  if (ip_only && l.host == "localhost") l.host = "127.0.0.1";
  if (ip_only && l.host.empty()) l.host = "0.0.0.0";
  return l;
}

}  // namespace

absl::Status CheckWritableFile(const std::string& what, const std::string& flag, const std::string& path,
                               bool replaced) {
  const std::string dir = FolderOf(path);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(what, " ", path, ": its folder ", dir,
                                                      " does not exist (or is not a folder); create it, writable by "
                                                      "the daemon's user, or give another ",
                                                      flag));
  }
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " ", path, " is a folder; give a file's path with ", flag));
  }
  if (const int err = CreateErrorIn(dir); err != 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, " ", path, ": its folder ", dir,
                                                      " does not take new files (", std::strerror(err),
                                                      "); make it writable by the daemon's user or give another ",
                                                      flag));
  }
  if (!replaced && ::stat(path.c_str(), &st) == 0) {  // Present: it must open for writing (nothing is written).
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat(what, " ", path, " exists and does not open for writing (",
                                                        std::strerror(errno), "); give the daemon's user write access ",
                                                        "to it, or give another ", flag));
    }
    ::close(fd);
  }
  return absl::OkStatus();
}

std::vector<std::string> CheckServingNeeds(const CoordinatorOptions& o) {
  std::vector<std::string> problems;
  auto add = [&problems](const absl::Status& s) {
    if (!s.ok()) problems.emplace_back(s.message());
  };
  add(CheckTls(o.tls));
  if (o.tls.enabled()) add(CheckTlsCopyFolder());
  if (!o.token_file.empty()) add(Tokens::Load(o.token_file).status());
  if (!o.journal_file.empty()) add(CheckJournalFile(o.journal_file));
  if (!o.state_file.empty()) add(CheckStateFile(o.state_file));
  if (!o.address_file.empty()) add(CheckWritableFile("address file", "--address-file", o.address_file));
  std::vector<int> held;
  const Listener grpc = SplitListener("listen", "--listen", o.listen_address, false);
  add(ProbeListener(grpc, false, "", held));
  if (!o.http_listen.empty()) {
    const Listener http = SplitListener("http_listen", "--http-listen", o.http_listen, true);
    const bool same_port = http.port == grpc.port && http.port != "0";
    add(ProbeListener(http, true, same_port ? absl::StrCat("listen ", o.listen_address) : "", held));
  }
  for (const int fd : held) ::close(fd);
  return problems;
}

}  // namespace shardcoord::coordinator
