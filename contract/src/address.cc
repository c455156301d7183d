#include "shardcoord/address.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardcoord {
namespace {

// Splits a checked address into host and port.
void Split(absl::string_view address, absl::string_view* host, absl::string_view* port) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    *host = address.substr(1, close - 1);
    *port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    *host = address.substr(0, colon);
    *port = address.substr(colon + 1);
  }
}

// One non-blocking connect to `ai`, waited for at most `timeout`: 0, or the errno it failed with
// (ETIMEDOUT when nothing answered in time).
int TryConnect(const addrinfo* ai, absl::Duration timeout) {
  const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return errno;
  int err = 0;
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int ready = poll(&p, 1, static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout))));
      if (ready <= 0) {
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof(err);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      }
    }
  }
  close(fd);
  return err;
}

}  // namespace

std::string AddressProblem(absl::string_view address) {
  if (absl::StrContains(address, "://")) {
    return "a URL is not an address: give HOST:PORT without a scheme, e.g. 127.0.0.1:7871";
  }
  absl::string_view host, port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return "no ']' after the IPv6 host";
    host = address.substr(1, close - 1);
    if (close + 1 >= address.size() || address[close + 1] != ':') return "no ':PORT' after ']'";
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return "no ':PORT' (give HOST:PORT, e.g. 127.0.0.1:7871)";
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (absl::StrContains(host, ':')) return "an IPv6 host needs brackets, [::1]:7871";
  }
  if (host.empty()) return "the host is empty";
  for (char c : host) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == '/') return "the host is not a host name or IP";
  }
  int value = 0;
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) {
        return absl::ascii_isdigit(static_cast<unsigned char>(c));
      })) {
    return absl::StrCat("the port '", port, "' is not a number in 1..65535");
  }
  if (!absl::SimpleAtoi(port, &value) || value < 1 || value > 65535) {
    return absl::StrCat("the port ", port, " is not in 1..65535");
  }
  return "";
}

std::string AddressHost(absl::string_view address) {
  absl::string_view host, port;
  Split(address, &host, &port);
  return std::string(host);
}

std::string ReachProblem(absl::string_view address, absl::Duration timeout) {
  absl::string_view host_view, port_view;
  Split(address, &host_view, &port_view);
  const std::string host(host_view), port(port_view);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::StrCat("the host '", host, "' does not resolve: ", gai_strerror(rc));
  }
  int err = ENOENT;
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    err = TryConnect(ai, timeout);
    if (err == 0) break;
  }
  freeaddrinfo(found);
  if (err == 0) return "";
  if (err == ECONNREFUSED) return absl::StrCat("connection refused: nothing listens on ", address);
  if (err == ETIMEDOUT) {
    return absl::StrCat("no answer from ", address, " within ", absl::ToInt64Milliseconds(timeout),
                        " ms (a firewall, or a host that is down)");
  }
  return absl::StrCat("cannot connect to ", address, ": ", std::strerror(err));
}

}  // namespace shardcoord
