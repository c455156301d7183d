#include "shardcoord/channel_credentials.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace shardcoord {
namespace {

std::string FromEnv(const std::string& given, const char* env) {
  if (!given.empty()) return given;
  const char* v = std::getenv(env);
  return v == nullptr ? std::string() : std::string(v);
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what, const char* env) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in || text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("TLS ", what, " file ", path, " (given, or from $", env,
                                                   ") cannot be read or holds no PEM block; give a readable PEM file"));
  }
  return text.str();
}

}  // namespace

TlsFiles ResolveTls(const TlsFiles& explicit_files) {
  TlsFiles t;
  t.ca_file = FromEnv(explicit_files.ca_file, kTlsCaEnv);
  t.cert_file = FromEnv(explicit_files.cert_file, kTlsCertEnv);
  t.key_file = FromEnv(explicit_files.key_file, kTlsKeyEnv);
  t.server_name = FromEnv(explicit_files.server_name, kTlsServerNameEnv);
  return t;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(const TlsFiles& tls,
                                                                               grpc::ChannelArguments& args) {
  if (!tls.enabled()) {
    if (!tls.cert_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("a TLS client certificate (", tls.cert_file,
                                                     ") needs the CA file that signed the coordinator's: give $",
                                                     kTlsCaEnv, " or --tls-ca"));
    }
    return grpc::InsecureChannelCredentials();
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a TLS client certificate needs its key and a key its certificate ($",
                                                   kTlsCertEnv, ", $", kTlsKeyEnv, ")"));
  }
  grpc::SslCredentialsOptions ssl;
  auto ca = ReadPem(tls.ca_file, "CA", kTlsCaEnv);
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *std::move(ca);
  if (!tls.cert_file.empty()) {
    auto cert = ReadPem(tls.cert_file, "client certificate", kTlsCertEnv);
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(tls.key_file, "client key", kTlsKeyEnv);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  return grpc::SslCredentials(ssl);
}

}  // namespace shardcoord
