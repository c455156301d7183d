#include "support/daemon.h"

#include <cstdio>

#include "support/test_env.h"

namespace shardcoord::testing {

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const std::string& dir, const std::vector<std::string>& flags,
                                                       const std::string& listen, const std::string& name) {
  auto d = std::unique_ptr<Daemon>(new Daemon);
  d->dir_ = dir;
  d->name_ = name;
  const std::string addr_file = dir + "/" + name + ".addr";
  std::remove(addr_file.c_str());
  std::vector<std::string> argv = {SHARDCOORDD_PATH, "--listen", listen, "--address-file", addr_file};
  argv.insert(argv.end(), flags.begin(), flags.end());
  d->process_ = std::make_unique<Subprocess>(argv, dir + "/" + name + ".out", dir + "/" + name + ".err");
  const bool up = WaitUntil([&] { return ReadFile(addr_file).find(':') != std::string::npos; }, absl::Seconds(20));
  if (!up) return absl::UnavailableError("shardcoordd did not start: " + d->Stderr());
  d->address_ = ReadFile(addr_file);
  d->address_.erase(d->address_.find_last_not_of('\n') + 1);
  return d;
}

std::string Daemon::Stderr() const { return ReadFile(dir_ + "/" + name_ + ".err"); }

}  // namespace shardcoord::testing
