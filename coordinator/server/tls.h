// TLS for the daemon (DESIGN 13). With a certificate and key the daemon serves TLS only;
// with a client CA as well, it requires each caller's certificate to be signed by that CA
// (mutual TLS). The files are watched: a renewed certificate, key or CA written in place is
// used for new connections within `tls_reload_interval`, without a restart.
#ifndef SHARDCOORD_COORDINATOR_SERVER_TLS_H_
#define SHARDCOORD_COORDINATOR_SERVER_TLS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/settings/options.h"

namespace grpc {
class ServerCredentials;
class ChannelCredentials;
}  // namespace grpc

namespace shardcoord::coordinator {

// Checks the settings before serving: both files given, readable, parseable; the key matches
// the certificate; the key is not open to others; the certificate is valid now (not expired,
// not before its start); the CA bundle holds at least one certificate. Each error names the
// file and what to do.
absl::Status CheckTls(const TlsSettings& tls);

// The files gRPC serves TLS from: a private copy of the configured certificate, key and CA
// (a 0700 directory of its own), replaced whole, by one rename, only with files that pass
// CheckTls. A renewal caught half-written (the certificate before its key), a certificate not
// yet valid or one already expired leaves the previous set serving, with one warning naming
// the file and why, instead of failing every handshake (and then the listener self-check).
// A thread re-reads the configured files every `reload_interval`; gRPC re-reads the copy
// every second.
class TlsCopy {
 public:
  // Copies the configured files (which must pass CheckTls) and starts watching them.
  static absl::StatusOr<std::unique_ptr<TlsCopy>> Start(const TlsSettings& configured);
  ~TlsCopy();  // Stops watching; removes the copy.
  TlsCopy(const TlsCopy&) = delete;
  TlsCopy& operator=(const TlsCopy&) = delete;

  // The settings naming the copy: serve and self-check from these.
  const TlsSettings& served() const { return served_; }
  // Re-reads the configured files now (the watcher's step; tests call it directly). OK when
  // nothing changed or the change is installed; otherwise why it was not (the previous set
  // keeps serving).
  absl::Status Refresh();

 private:
  struct Impl;
  explicit TlsCopy(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  TlsSettings served_;
};

// The listening credentials: TLS from the watched files, or plaintext when not enabled.
std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsSettings& tls);

// Whether the daemon's own certificate passes as a client certificate under the client CA
// (signed by it, usable for client authentication): then the self-check can present it under
// mutual TLS. Without it the self-check would be refused at each handshake, so it is off.
bool ServerCertificateIsAClient(const TlsSettings& tls);

// Credentials for the daemon's own self-check: TLS without verifying the server (it is
// ourselves), presenting the daemon's certificate under mutual TLS; or plaintext.
std::shared_ptr<grpc::ChannelCredentials> SelfCheckCredentials(const TlsSettings& tls);

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_SERVER_TLS_H_
