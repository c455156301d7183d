// Small helpers for tests: temporary directories and deadline-bounded waiting.
#ifndef SHARDCOORD_TESTS_SUPPORT_TEST_ENV_H_
#define SHARDCOORD_TESTS_SUPPORT_TEST_ENV_H_

#include <functional>
#include <string>

#include "absl/time/time.h"

namespace shardcoord::testing {

// Time allowed on top of a protocol deadline (heartbeat timeout, op timeout) for what a
// loaded 2-core machine may delay: process start, scheduling, a poll that forks shardctl.
// Bounds stay finite, so a hang still fails the test; they only stop measuring noise.
inline constexpr absl::Duration kLoadSlack = absl::Seconds(15);

// A loopback TCP port that refuses connections for as long as this object lives: the socket
// is bound but never listens, so no other process can take the port in the meantime (a port
// found by binding and releasing it could be taken by anyone before the test uses it).
class RefusingPort {
 public:
  RefusingPort();
  ~RefusingPort();
  RefusingPort(const RefusingPort&) = delete;
  RefusingPort& operator=(const RefusingPort&) = delete;
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Evaluates `cond` until it is true or `timeout` passes; returns its last value. For
// conditions observed from outside (a file appearing, a status reported over RPC).
bool WaitUntil(const std::function<bool()>& cond, absl::Duration timeout,
               absl::Duration poll = absl::Milliseconds(20));

std::string ReadFile(const std::string& path);

// Puts a copy of `from` in place of `to` at once (written beside it, mode 0600, renamed over it),
// as a certificate renewal does. False when either file cannot be used.
bool ReplaceFile(const std::string& from, const std::string& to);

// A plain TCP connection to 127.0.0.1:port (a raw client: idle, slow or flooding); -1 on failure.
// `from`: the loopback address the connection comes from (e.g. "127.0.0.2": another client
// address on the same host); null: the kernel's choice.
int ConnectLoopback(int port, const char* from = nullptr);

}  // namespace shardcoord::testing

#endif  // SHARDCOORD_TESTS_SUPPORT_TEST_ENV_H_
