#include "coordinator/core/resume_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {
namespace {

constexpr size_t kMacBytes = 16;
constexpr size_t kKeyBytes = 32;

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    std::abort();  // No randomness: nothing secure can be done.
  }
  return out;
}

bool SameBytes(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// Length-prefixed fields: no two different field lists give the same bytes.
void Field(std::string* out, const std::string& value) { absl::StrAppend(out, value.size(), ":", value, ";"); }

}  // namespace

struct ResumeAuthority::Pads {
  EVP_MD_CTX* inner = EVP_MD_CTX_new();  // SHA-256 after (key ^ ipad).
  EVP_MD_CTX* outer = EVP_MD_CTX_new();  // SHA-256 after (key ^ opad).
  ~Pads() {
    EVP_MD_CTX_free(inner);
    EVP_MD_CTX_free(outer);
  }
};

// HMAC's definition (RFC 2104), its pads hashed once; the same bytes as OpenSSL's HMAC().
std::shared_ptr<const ResumeAuthority::Pads> ResumeAuthority::MakePads(const std::string& key) {
  constexpr size_t kBlock = 64;  // SHA-256's.
  unsigned char k[kBlock] = {};
  if (key.size() > kBlock) {
    SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), k);
  } else {
    std::memcpy(k, key.data(), key.size());
  }
  auto pads = std::make_shared<ResumeAuthority::Pads>();
  unsigned char ipad[kBlock], opad[kBlock];
  for (size_t i = 0; i < kBlock; ++i) {
    ipad[i] = k[i] ^ 0x36;
    opad[i] = k[i] ^ 0x5c;
  }
  if (pads->inner == nullptr || pads->outer == nullptr || EVP_DigestInit_ex(pads->inner, EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(pads->inner, ipad, kBlock) != 1 || EVP_DigestInit_ex(pads->outer, EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(pads->outer, opad, kBlock) != 1) {
    std::abort();  // No SHA-256: nothing secure can be done.
  }
  OPENSSL_cleanse(k, kBlock);
  OPENSSL_cleanse(ipad, kBlock);
  OPENSSL_cleanse(opad, kBlock);
  return pads;
}

ResumeAuthority::ResumeAuthority(std::string key, bool persistent)
    : pads_(MakePads(key)), persistent_(persistent) {
  OPENSSL_cleanse(key.data(), key.size());
}

ResumeAuthority ResumeAuthority::Ephemeral() { return ResumeAuthority(RandomBytes(kKeyBytes), false); }

ResumeAuthority ResumeAuthority::ForRun(const std::string& job, const std::string& run) const {
  std::string message = "shardcoord run key 1;";
  Field(&message, job);
  Field(&message, run);
  return ResumeAuthority(Mac(message), persistent_);
}

std::string ResumeAuthority::NewRunId() { return absl::BytesToHexString(RandomBytes(kMacBytes)); }

bool ResumeAuthority::IsRunId(const std::string& run) {
  return run.size() == 2 * kMacBytes && run.find_first_not_of("0123456789abcdef") == std::string::npos;
}

std::string ResumeAuthority::Mac(const std::string& message) const {
  unsigned char inner[EVP_MAX_MD_SIZE], mac[EVP_MAX_MD_SIZE];
  unsigned int inner_len = 0, len = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  if (ctx == nullptr || EVP_MD_CTX_copy_ex(ctx, pads_->inner) != 1 ||
      EVP_DigestUpdate(ctx, message.data(), message.size()) != 1 || EVP_DigestFinal_ex(ctx, inner, &inner_len) != 1 ||
      EVP_MD_CTX_copy_ex(ctx, pads_->outer) != 1 || EVP_DigestUpdate(ctx, inner, inner_len) != 1 ||
      EVP_DigestFinal_ex(ctx, mac, &len) != 1) {
    std::abort();  // As above: a MAC that cannot be made must not be skipped.
  }
  EVP_MD_CTX_free(ctx);
  return std::string(reinterpret_cast<const char*>(mac), kMacBytes);
}

std::string ResumeAuthority::Credential(const std::string& job, int rank, uint64_t incarnation,
                                        uint64_t serial) const {
  std::string message = "shardcoord resume credential 2;";
  Field(&message, job);
  Field(&message, absl::StrCat(rank));
  Field(&message, absl::StrCat(incarnation));
  Field(&message, absl::StrCat(serial));
  return absl::BytesToHexString(Mac(message));
}

bool ResumeAuthority::CheckCredential(const std::string& job, int rank, uint64_t incarnation, uint64_t serial,
                                      const std::string& credential) const {
  return SameBytes(Credential(job, rank, incarnation, serial), credential);
}

std::string ResumeAuthority::Seal(const std::string& job, const v1::MicrobatchDecision& d) const {
  std::string message = "shardcoord decision seal 1;";
  Field(&message, job);
  for (int64_t v : {int64_t{d.group()}, d.key().step(), int64_t{d.key().microbatch()}, static_cast<int64_t>(d.seq()), d.epoch(),
                    static_cast<int64_t>(d.digest())}) {
    Field(&message, absl::StrCat(v));
  }
  for (const auto& m : d.modules()) {
    Field(&message, m.module());
    Field(&message, absl::StrCat(static_cast<int>(m.decision()), ",", static_cast<int>(m.reason())));
    // A padded decision's passes are sealed too (a forged count would hang the group); other
    // decisions seal as before, so seals made by earlier versions still verify.
    if (m.decision() == v1::DECISION_PADDED) Field(&message, absl::StrCat("calls=", m.calls()));
  }
  return Mac(message);
}

bool ResumeAuthority::CheckSeal(const std::string& job, const v1::MicrobatchDecision& d) const {
  return SameBytes(Seal(job, d), d.seal());
}

namespace {

constexpr size_t kKeyFileMaxBytes = 4096;  // A key file is one line of 64 hex digits.

// Reads the resume key file as the TLS key is read: not through a symbolic link, a regular file
// of this user's that nobody else may read or write, at most a few bytes, 64 hex digits of a key
// that is not all zero. NotFound when there is none (one is made); every other failure says what
// is wrong and what to do.
absl::StatusOr<std::string> ReadKeyFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(path);
    if (err == ELOOP) {
      return absl::PermissionDeniedError(absl::StrCat("resume key file ", path, " is a symbolic link; a key is "
                                                      "read only from a file of its own: replace the link by the file"));
    }
    return absl::PermissionDeniedError(absl::StrCat("resume key file ", path, " cannot be read: ",
                                                    std::strerror(err), "; it must be readable by the daemon's user"));
  }
  struct stat st;
  std::string content(kKeyFileMaxBytes + 1, '\0');
  ssize_t got = -1;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) got = ::read(fd, content.data(), content.size());
  ::close(fd);
  if (!S_ISREG(st.st_mode)) {
    return absl::PermissionDeniedError(absl::StrCat("resume key file ", path, " is not a regular file"));
  }
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {  // Root's or its own: nobody else could plant it.
    return absl::PermissionDeniedError(absl::StrCat("resume key file ", path, " belongs to uid ", st.st_uid,
                                                    ", neither the daemon's user (uid ", ::geteuid(),
                                                    ") nor root: another user could have planted it; chown it, or "
                                                    "delete it"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "resume key file %s has mode %04o: others may read or change it (whoever reads it can forge resumes); "
        "chmod 600 it", path, st.st_mode & 07777));
  }
  if (got < 0) return absl::UnavailableError(absl::StrCat("cannot read the resume key file ", path));
  content.resize(static_cast<size_t>(got));
  if (content.size() > kKeyFileMaxBytes) {
    return absl::DataLossError(absl::StrCat("resume key file ", path, " is longer than ", kKeyFileMaxBytes,
                                            " bytes: not a key file; restore it, or delete it"));
  }
  if (content.empty()) return absl::NotFoundError(absl::StrCat(path, " is empty"));  // Never written: remade.
  const std::string hex(absl::StripAsciiWhitespace(content));
  const bool is_hex = hex.size() == 2 * kKeyBytes && hex.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos;
  const std::string key = is_hex ? absl::HexStringToBytes(hex) : "";
  if (key.size() != kKeyBytes) {
    return absl::DataLossError(absl::StrCat("resume key file ", path, " does not hold ", kKeyBytes * 2,
                                            " hex digits: restore it, or delete it (a new key is made, and ranks "
                                            "registered before cannot resume)"));
  }
  if (key.find_first_not_of('\0') == std::string::npos) {
    return absl::DataLossError(absl::StrCat("resume key file ", path, " holds an all-zero key, which anyone could "
                                            "guess: delete it (a new key is made)"));
  }
  return key;
}

// Makes the key file atomically: the key is written and synced under a temporary name, then
// linked to `path` (which fails if another start made it meanwhile: that one is read), so a crash
// never leaves a partial or empty key file behind.
absl::StatusOr<std::string> CreateKeyFile(const std::string& path) {
  const std::string key = RandomBytes(kKeyBytes);
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  ::unlink(tmp.c_str());  // A leftover of a crashed start with this pid.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create the resume key file ", path, " (writing ", tmp,
                                                    "): ", std::strerror(errno), "; make its folder writable"));
  }
  const std::string line = absl::StrCat(absl::BytesToHexString(key), "\n");
  const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write the resume key file ", tmp));
  }
  const int linked = ::link(tmp.c_str(), path.c_str());
  const int err = errno;
  ::unlink(tmp.c_str());
  if (linked != 0 && err == EEXIST) return ReadKeyFile(path);  // Another start made it first.
  if (linked != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create the resume key file ", path, ": ",
                                                    std::strerror(err)));
  }
  return key;
}

}  // namespace

absl::Status CheckTokenFileShape(const std::string& path, const struct stat& st) {
  if (S_ISREG(st.st_mode) && st.st_size <= kMaxTokenFileBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("token file ", path, " is not a regular file of at most ",
                                                 kMaxTokenFileBytes, " bytes; give the file of 'ROLE TOKEN [job=ID]' "
                                                 "lines"));
}

absl::StatusOr<ResumeKey> LoadResumeKey(const std::string& state_file, const std::string& token_file) {
  if (!state_file.empty()) {
    const std::string path = state_file + ".key";
    absl::StatusOr<std::string> key = ReadKeyFile(path);
    if (absl::IsNotFound(key.status()) && key.status().message() != path) {
      // Empty: a crash of a version that wrote it in place left it so; it holds no key to keep.
      logging::Get("coordinator")->warn("resume key file {} is empty; a new key is made", path);
      ::unlink(path.c_str());
    }
    if (absl::IsNotFound(key.status())) key = CreateKeyFile(path);
    if (!key.ok()) return key.status();
    return ResumeKey{*key, path};
  }
  if (!token_file.empty()) {
    // Read before the token table is (main.cc).
    struct stat st {};
    if (::stat(token_file.c_str(), &st) == 0) {
      if (absl::Status s = CheckTokenFileShape(token_file, st); !s.ok()) return s;
    }
    std::ifstream in(token_file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read the token file ", token_file));
    std::stringstream content;
    content << in.rdbuf();
    std::string message = "shardcoord resume key from tokens 1;" + content.str();
    unsigned char digest[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest);
    return ResumeKey{std::string(reinterpret_cast<const char*>(digest), SHA256_DIGEST_LENGTH),
                     absl::StrCat("the token file ", token_file)};
  }
  return absl::NotFoundError("no --state-file and no --token-file: resumes after a restart cannot be verified");
}

}  // namespace shardcoord::coordinator
