#include "coordinator/server/auth.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/core/resume_auth.h"
#include "coordinator/core/secrets.h"
#include "shardcoord/plan_check.h"

namespace shardcoord::coordinator {

const char* RoleName(Role role) {
  switch (role) {
    case Role::kRank: return "rank";
    case Role::kRead: return "read";
    case Role::kAdmin: return "admin";
  }
  return "?";
}

namespace {

std::string OctalMode(unsigned mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%03o", mode & 0777);
  return buf;
}

}  // namespace

absl::Status Grant::AllowsJob(const std::string& job_id, const char* method) const {
  if (job.empty() || job_id == job) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(method, ": the token is for job '", job,
                                                  "' only; use a token of job '", Printable(job_id), "'"));
}

absl::StatusOr<Tokens> Tokens::Load(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("token file ", path, " cannot be read"));
  }
  if (absl::Status s = CheckTokenFileShape(path, st); !s.ok()) return s;
  // Group read is allowed (a Kubernetes Secret mounted for fsGroup is 0440); others, never.
  if ((st.st_mode & 027) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("token file ", path, " is open to others or writable by its group (mode ",
                                                    OctalMode(st.st_mode), "); chmod 600 it"));
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("token file ", path, " cannot be read"));
  Tokens out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string text(absl::StripAsciiWhitespace(line.substr(0, line.find('#'))));
    if (text.empty()) continue;
    std::vector<std::string> f = absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat("token file ", path, " line ", n, ": ", what,
                                                     "; each line is 'ROLE TOKEN [job=ID]' with ROLE rank, read or admin"));
    };
    if (f.size() != 2 && f.size() != 3) return bad("expected two or three fields");
    std::string job;
    if (f.size() == 3) {
      if (f[2].rfind("job=", 0) != 0 || f[2].size() == 4) return bad("the third field must be job=ID");
      job = f[2].substr(4);
    }
    Role role;
    if (f[0] == "rank") {
      role = Role::kRank;
    } else if (f[0] == "read") {
      role = Role::kRead;
    } else if (f[0] == "admin") {
      role = Role::kAdmin;
    } else {
      return bad("unknown role");
    }
    if (f[1].size() < 16) return bad("the token is shorter than 16 bytes");
    out.tokens_.push_back({role, f[1], std::move(job)});
  }
  if (out.tokens_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds no token"));
  }
  return out;
}

absl::StatusOr<Grant> Tokens::Check(const std::string& authorization, Role needed, const char* method) const {
  if (!enabled()) return Grant{};
  constexpr char kBearer[] = "Bearer ";
  if (authorization.rfind(kBearer, 0) != 0) {
    return absl::UnauthenticatedError(absl::StrCat(
        method, ": no token; this coordinator requires `authorization: Bearer <token>` (the worker and shardctl "
        "read it from $SHARDCOORD_TOKEN or the file named by $SHARDCOORD_TOKEN_FILE)"));
  }
  const std::string given = authorization.substr(sizeof(kBearer) - 1);
  bool known = false, allowed = false;
  Grant grant;
  for (const Entry& e : tokens_) {  // Every token compared, in constant time each.
    if (!SameSecret(given, e.token)) continue;
    known = true;
    if (e.role != Role::kAdmin && e.role != needed) continue;
    // The same token listed twice: the widest grant (admin over a role, every job over one).
    const auto width = [](Role r, const std::string& job) { return std::make_pair(r == Role::kAdmin, job.empty()); };
    if (!allowed || width(e.role, e.job) > width(grant.role, grant.job)) grant = {e.role, e.job};
    allowed = true;
  }
  if (!known) return absl::UnauthenticatedError(absl::StrCat(method, ": the token is not one this coordinator knows"));
  if (!allowed) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, ": needs a token of role ", RoleName(needed), " (or admin)"));
  }
  return grant;
}

}  // namespace shardcoord::coordinator
