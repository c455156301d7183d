#include "coordinator/core/run_pins.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/engine/text.h"

namespace shardcoord::coordinator {
namespace {

constexpr char kHeader[] = "shardcoordd-runs 1";

}  // namespace

std::string RunPinsPath(const std::string& state_file) { return state_file.empty() ? "" : state_file + ".runs"; }

absl::StatusOr<RunPins> ReadRunPins(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("runs file ", path, " does not exist or cannot be read"));
  auto bad = [&](const std::string& what) { return absl::DataLossError(absl::StrCat("runs file ", path, " ", what)); };
  std::string content(kMaxRunPinsBytes + 1, '\0');
  in.read(content.data(), static_cast<std::streamsize>(content.size()));
  content.resize(static_cast<size_t>(in.gcount()));
  if (content.size() > kMaxRunPinsBytes) return bad(absl::StrCat("is larger than ", kMaxRunPinsBytes, " bytes"));
  std::vector<std::string> lines = absl::StrSplit(content, '\n');
  if (lines.size() < 3 || lines[0] != kHeader || !lines.back().empty()) {
    return bad(absl::StrCat("does not start with '", kHeader, "' or is cut short"));
  }
  lines.pop_back();
  const std::string check = lines.back();
  lines.pop_back();
  std::string body;
  RunPins pins;
  for (size_t i = 1; i < lines.size(); ++i) {
    absl::StrAppend(&body, lines[i], "\n");
    const std::vector<std::string> parts = absl::StrSplit(lines[i], ' ');
    std::string job;
    if (parts.size() != 2 || !ResumeAuthority::IsRunId(parts[0]) || parts[1].size() % 2 != 0 ||
        parts[1].find_first_not_of("0123456789abcdef") != std::string::npos) {
      return bad(absl::StrCat("line ", i + 1, " is not '<run id> <job id in hex>'"));
    }
    pins[absl::HexStringToBytes(parts[1])] = parts[0];
  }
  uint64_t sum = 0;
  if (check.rfind("check ", 0) != 0 || !absl::SimpleAtoi(check.substr(6), &sum) || sum != Fnv1a(body)) {
    return bad("fails its checksum (truncated or edited)");
  }
  return pins;
}

absl::Status WriteRunPins(const std::string& path, const RunPins& pins) {
  std::string body;
  for (const auto& [job, run] : pins) absl::StrAppend(&body, run, " ", absl::BytesToHexString(job), "\n");
  const std::string content = absl::StrCat(kHeader, "\n", body, "check ", Fnv1a(body), "\n");
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace shardcoord::coordinator
