#include "coordinator/server/tls.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {
namespace {

// The latest OpenSSL error as text ("" when none), clearing the queue.
std::string OpenSslError() {
  std::string text;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    text = buf;
  }
  return text;
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

absl::StatusOr<File> Open(const std::string& path, const char* what) {
  File f(std::fopen(path.c_str(), "r"));
  if (!f) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " cannot be read; give a readable PEM file"));
  }
  return f;
}

// Certificates in a PEM file (0 when none parse).
int CountCertificates(FILE* f) {
  int n = 0;
  while (X509* c = PEM_read_X509(f, nullptr, nullptr, nullptr)) {
    X509_free(c);
    n++;
  }
  ERR_clear_error();  // The end of the file reads as an error.
  return n;
}

absl::Status CheckKeyMode(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("TLS key file ", path, " cannot be read"));
  }
  if ((st.st_mode & 027) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TLS key file %s has mode %04o: others may read it or its group write it; chmod 600 it "
        "(0440 with fsGroup for a Kubernetes Secret)",
        path, st.st_mode & 07777));
  }
  return absl::OkStatus();
}

absl::Status CheckCertificateAndKey(const TlsSettings& tls) {
  auto cert_file = Open(tls.cert_file, "TLS certificate");
  if (!cert_file.ok()) return cert_file.status();
  std::unique_ptr<X509, decltype(&X509_free)> cert(PEM_read_X509(cert_file->get(), nullptr, nullptr, nullptr),
                                                   X509_free);
  if (!cert) {
    return absl::InvalidArgumentError(absl::StrCat("TLS certificate ", tls.cert_file,
                                                   " holds no PEM certificate (", OpenSslError(), ")"));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS certificate ", tls.cert_file, " has expired; renew it"));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert.get())) > 0) {
    // Served, every client would fail with only "certificate verify failed".
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS certificate ", tls.cert_file, " is not valid yet (its notBefore is in the future): every client would "
        "refuse it; check this host's clock (timedatectl) or issue the certificate with an earlier start"));
  }
  if (absl::Status s = CheckKeyMode(tls.key_file); !s.ok()) return s;
  auto key_file = Open(tls.key_file, "TLS key");
  if (!key_file.ok()) return key_file.status();
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_PrivateKey(key_file->get(), nullptr, nullptr, nullptr), EVP_PKEY_free);
  if (!key) {
    return absl::InvalidArgumentError(absl::StrCat("TLS key ", tls.key_file,
                                                   " holds no unencrypted PEM private key (", OpenSslError(), ")"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    OpenSslError();
    return absl::InvalidArgumentError(absl::StrCat("TLS key ", tls.key_file, " does not belong to certificate ",
                                                   tls.cert_file, "; give the key the certificate was issued for"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTls(const TlsSettings& tls) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate (--tls-cert-file) and its key (--tls-key-file)");
  }
  if (!tls.enabled()) {
    if (tls.mutual()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca-file needs --tls-cert-file and --tls-key-file: client certificates are checked only over TLS");
    }
    return absl::OkStatus();
  }
  if (tls.reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError("TLS reload interval must be >= 1 s");
  }
  if (absl::Status s = CheckCertificateAndKey(tls); !s.ok()) return s;
  if (tls.mutual()) {
    auto ca = Open(tls.client_ca_file, "TLS client CA");
    if (!ca.ok()) return ca.status();
    if (CountCertificates(ca->get()) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS client CA ", tls.client_ca_file, " holds no PEM certificate"));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// TlsCopy

namespace {

// A file's bytes; nullopt when it cannot be read.
std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

bool WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  out.close();
  return out.good() && chmod(path.c_str(), 0600) == 0;
}

// A daemon killed with SIGKILL leaves its copy (a private key among it): the copies of
// processes that are gone are removed at the next start.
void RemoveCopiesOfDeadDaemons(const std::string& parent) {
  std::error_code ec;
  const std::string prefix = "shardcoordd-tls-";
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    struct stat st {};
    if (pid <= 0 || stat(entry.path().c_str(), &st) != 0 || st.st_uid != getuid()) continue;
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // Alive (or not ours to judge).
    std::filesystem::remove_all(entry.path(), ec);
  }
}

}  // namespace

struct TlsCopy::Impl {
  TlsSettings configured;
  std::string dir;  // The private copy: dir/gen-N/{cert,key,ca}.pem, dir/current -> gen-N.
  int generation = 0;
  std::string installed;  // The configured files' bytes as last installed.
  std::string refused;    // As last refused (warned about once).
  absl::Mutex refresh_mu;  // One Refresh at a time (the watcher's, a test's).
  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::thread watcher;

  std::string Path(int gen, const char* name) const { return absl::StrCat(dir, "/gen-", gen, "/", name); }

  // Writes `bytes` (cert, key, ca) as the next generation and checks it; installs it by
  // renaming the `current` link over, or says why not (naming the configured files).
  absl::Status Install(const std::string& cert, const std::string& key, const std::string& ca) {
    const int gen = generation + 1;
    std::error_code ec;
    std::filesystem::create_directory(absl::StrCat(dir, "/gen-", gen), ec);
    TlsSettings staged{Path(gen, "cert.pem"), Path(gen, "key.pem"), configured.mutual() ? Path(gen, "ca.pem") : "",
                       configured.reload_interval};
    if (!WriteFile(staged.cert_file, cert) || !WriteFile(staged.key_file, key) ||
        (configured.mutual() && !WriteFile(staged.client_ca_file, ca))) {
      std::filesystem::remove_all(absl::StrCat(dir, "/gen-", gen), ec);
      return absl::InternalError(absl::StrCat("cannot write the private copy of the TLS files in ", dir));
    }
    absl::Status s = CheckTls(staged);
    if (s.ok()) s = CheckKeyMode(configured.key_file);
    if (!s.ok()) {
      std::filesystem::remove_all(absl::StrCat(dir, "/gen-", gen), ec);
      return absl::Status(s.code(), absl::StrReplaceAll(s.message(), {{staged.cert_file, configured.cert_file},
                                                                      {staged.key_file, configured.key_file},
                                                                      {Path(gen, "ca.pem"), configured.client_ca_file}}));
    }
    const std::string link = absl::StrCat(dir, "/current"), tmp = absl::StrCat(dir, "/current.new");
    std::filesystem::remove(tmp, ec);
    if (symlink(absl::StrCat("gen-", gen).c_str(), tmp.c_str()) != 0 || rename(tmp.c_str(), link.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("cannot switch the private copy of the TLS files in ", dir));
    }
    generation = gen;
    // The one before stays: gRPC may be reading it right now.
    std::filesystem::remove_all(absl::StrCat(dir, "/gen-", gen - 2), ec);
    return absl::OkStatus();
  }
};

TlsCopy::TlsCopy(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  served_ = impl_->configured;
  served_.cert_file = impl_->dir + "/current/cert.pem";
  served_.key_file = impl_->dir + "/current/key.pem";
  if (served_.mutual()) served_.client_ca_file = impl_->dir + "/current/ca.pem";
  served_.reload_interval = absl::Seconds(1);  // gRPC's re-read of the copy.
}

absl::StatusOr<std::unique_ptr<TlsCopy>> TlsCopy::Start(const TlsSettings& configured) {
  auto impl = std::make_unique<Impl>();
  impl->configured = configured;
  const char* tmpdir = std::getenv("TMPDIR");
  const std::string parent = tmpdir != nullptr && *tmpdir != 0 ? tmpdir : "/tmp";
  RemoveCopiesOfDeadDaemons(parent);
  std::string templ = absl::StrCat(parent, "/shardcoordd-tls-", getpid(), "-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot create a private directory for the TLS files under ", templ.substr(0, templ.rfind('/')),
        "; set TMPDIR to a writable directory"));
  }
  impl->dir = templ;
  std::unique_ptr<TlsCopy> files(new TlsCopy(std::move(impl)));
  if (absl::Status s = files->Refresh(); !s.ok()) return s;
  Impl* i = files->impl_.get();
  i->watcher = std::thread([i, files = files.get()] {
    absl::MutexLock lock(&i->mu);
    while (!i->mu.AwaitWithTimeout(absl::Condition(&i->stopping), i->configured.reload_interval)) {
      i->mu.Unlock();
      files->Refresh().IgnoreError();  // Refresh logs what it refused.
      i->mu.Lock();
    }
  });
  return files;
}

TlsCopy::~TlsCopy() {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopping = true;
  }
  if (impl_->watcher.joinable()) impl_->watcher.join();
  std::error_code ec;
  std::filesystem::remove_all(impl_->dir, ec);
}

absl::Status TlsCopy::Refresh() {
  Impl& i = *impl_;
  absl::MutexLock lock(&i.refresh_mu);
  const auto cert = ReadFile(i.configured.cert_file);
  const auto key = ReadFile(i.configured.key_file);
  const auto ca = i.configured.mutual() ? ReadFile(i.configured.client_ca_file) : std::optional<std::string>("");
  absl::Status s;
  std::string now = "(unreadable)";
  if (!cert || !key || !ca) {
    s = absl::InvalidArgumentError(absl::StrCat("TLS certificate ", i.configured.cert_file, ", key ",
                                                i.configured.key_file, " or client CA cannot be read"));
  } else {
    now = absl::StrCat(cert->size(), ":", *cert, key->size(), ":", *key, *ca);
    if (now == i.installed) return absl::OkStatus();
    s = i.Install(*cert, *key, *ca);
  }
  static const auto log = logging::Get("coordinator");
  if (s.ok()) {
    if (i.generation > 1) log->info("TLS files renewed: serving {} from now on", i.configured.cert_file);
    i.installed = std::move(now);
    i.refused.clear();
    return s;
  }
  if (now != i.refused) {
    if (i.generation > 0) {
      log->warn("TLS files changed but are not served: {}; the previous certificate keeps serving (checked again "
                "every {} s)",
                std::string(s.message()), absl::ToInt64Seconds(i.configured.reload_interval));
    }
    i.refused = now;
  }
  return s;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsSettings& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  const auto refresh = static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(tls.reload_interval)));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      tls.key_file, tls.cert_file, tls.client_ca_file, refresh);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (tls.mutual()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

bool ServerCertificateIsAClient(const TlsSettings& tls) {
  auto cert_file = Open(tls.cert_file, "TLS certificate");
  auto ca_file = Open(tls.client_ca_file, "TLS client CA");
  if (!cert_file.ok() || !ca_file.ok()) return false;
  std::unique_ptr<X509, decltype(&X509_free)> cert(PEM_read_X509(cert_file->get(), nullptr, nullptr, nullptr),
                                                   X509_free);
  std::unique_ptr<X509_STORE, decltype(&X509_STORE_free)> store(X509_STORE_new(), X509_STORE_free);
  std::unique_ptr<STACK_OF(X509), void (*)(STACK_OF(X509)*)> chain(
      sk_X509_new_null(), [](STACK_OF(X509)* s) { sk_X509_pop_free(s, X509_free); });
  if (!cert || !store) return false;
  while (X509* ca = PEM_read_X509(ca_file->get(), nullptr, nullptr, nullptr)) {
    X509_STORE_add_cert(store.get(), ca);
    X509_free(ca);
  }
  while (X509* more = PEM_read_X509(cert_file->get(), nullptr, nullptr, nullptr)) sk_X509_push(chain.get(), more);
  std::unique_ptr<X509_STORE_CTX, decltype(&X509_STORE_CTX_free)> ctx(X509_STORE_CTX_new(), X509_STORE_CTX_free);
  bool ok = ctx && X509_STORE_CTX_init(ctx.get(), store.get(), cert.get(), chain.get()) == 1 &&
            X509_STORE_CTX_set_purpose(ctx.get(), X509_PURPOSE_SSL_CLIENT) == 1 &&
            X509_verify_cert(ctx.get()) == 1;
  ERR_clear_error();
  return ok;
}

std::shared_ptr<grpc::ChannelCredentials> SelfCheckCredentials(const TlsSettings& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  if (tls.mutual()) {
    options.set_certificate_provider(std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        tls.key_file, tls.cert_file,
        static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(tls.reload_interval)))));
    options.watch_identity_key_cert_pairs();
  }
  options.set_verify_server_certs(false);
  options.set_check_call_host(false);
  options.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

}  // namespace shardcoord::coordinator
