#include "coordinator/daemon/state_file.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/engine/text.h"
#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {
namespace {

constexpr char kHeader[] = "shardcoordd-state 1";

}  // namespace

absl::StatusOr<uint64_t> ReadIncarnation(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("state file ", path, " does not exist or cannot be read"));
  std::string header, line, check;
  std::getline(in, header);
  std::getline(in, line);
  std::getline(in, check);
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("state file ", path, " ", what));
  };
  if (header != kHeader) return bad(absl::StrCat("does not start with '", kHeader, "'"));
  uint64_t incarnation = 0, sum = 0;
  if (line.rfind("incarnation ", 0) != 0 || !absl::SimpleAtoi(line.substr(12), &incarnation)) {
    return bad("has no valid 'incarnation N' line");
  }
  if (check.rfind("check ", 0) != 0 || !absl::SimpleAtoi(check.substr(6), &sum) || sum != Fnv1a(line)) {
    return bad("fails its checksum (truncated or edited)");
  }
  return incarnation;
}

absl::Status WriteIncarnation(const std::string& path, uint64_t incarnation) {
  const std::string tmp = path + ".tmp";
  const std::string line = absl::StrCat("incarnation ", incarnation);
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kHeader << "\n" << line << "\ncheck " << Fnv1a(line) << "\n";
    out.flush();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

uint64_t NextIncarnation(const std::string& path, absl::Time now) {
  uint64_t next = static_cast<uint64_t>(absl::ToUnixMicros(now));
  if (path.empty()) return next;
  auto log = logging::Get("coordinator");
  absl::StatusOr<uint64_t> stored = ReadIncarnation(path);
  if (stored.ok() && *stored >= (uint64_t{1} << 62)) {
    // Far beyond any clock (microseconds since 1970 are about 2^50): a forged or corrupt file,
    // whose +1 would one day wrap to 0 and make every later incarnation look older.
    log->warn("state file {} holds incarnation {}, beyond any clock; ignored", path, *stored);
  } else if (stored.ok()) {
    next = std::max(next, *stored + 1);
  } else if (!absl::IsNotFound(stored.status())) {
    log->warn("{}; ignored (it only keeps incarnations increasing if the clock steps back)",
              std::string(stored.status().message()));
  }
  if (absl::Status s = WriteIncarnation(path, next); !s.ok()) {
    log->warn("state file: {}; the next start falls back to the clock", std::string(s.message()));
  }
  return next;
}

}  // namespace shardcoord::coordinator
