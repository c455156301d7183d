#include "coordinator/tls.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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
    return absl::InvalidArgumentError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)");
  }
  if (!tls.enabled()) {
    if (tls.mutual()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked only over TLS");
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
