// Test certificates made with the openssl CLI: a CA, a server certificate for localhost and
// 127.0.0.1 signed by it, a client certificate signed by it, and a second, unrelated CA with
// its own server certificate (for "wrong CA" and reload checks). Keys are mode 0600.
#ifndef SHARDCOORD_TESTS_SUPPORT_CERTS_H_
#define SHARDCOORD_TESTS_SUPPORT_CERTS_H_

#include <string>

#include "absl/status/statusor.h"

namespace shardcoord::testing {

struct CertSet {
  std::string ca, server_cert, server_key, client_cert, client_key;
  std::string other_ca, other_server_cert, other_server_key;
};

// Writes the files into `dir` (which must exist). UNAVAILABLE when openssl fails.
absl::StatusOr<CertSet> MakeCertificates(const std::string& dir);

}  // namespace shardcoord::testing

#endif  // SHARDCOORD_TESTS_SUPPORT_CERTS_H_
