// libFuzzer target: the daemon's YAML config file (coordinator/options.h LoadConfigFile,
// then ValidateOptions) and its token file (auth.h Tokens::Load), read from an in-memory
// file as the daemon reads a real one. Seeds: deploy/config/. The first input byte picks the
// parser.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "coordinator/server/auth.h"
#include "coordinator/settings/options.h"
#include "shardcoord/internal/logging.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  shardcoord::logging::SetLevel("off");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool tokens = data[0] & 1;
  const int fd = memfd_create("fuzz-config", 0);
  if (fd < 0) std::abort();
  if (size > 1 && write(fd, data + 1, size - 1) != static_cast<ssize_t>(size - 1)) std::abort();
  fchmod(fd, 0600);
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (tokens) {
    auto t = shardcoord::coordinator::Tokens::Load(path);
    if (t.ok()) (void)t->Check("Bearer 0123456789abcdef0123", shardcoord::coordinator::Role::kRank, "fuzz");
  } else {
    auto o = shardcoord::coordinator::LoadConfigFile(path);
    if (o.ok()) (void)shardcoord::coordinator::ValidateOptions(*o);
  }
  close(fd);
  return 0;
}
