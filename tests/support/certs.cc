#include "support/certs.h"

#include <sys/stat.h>

#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "support/subprocess.h"

namespace shardcoord::testing {
namespace {

absl::Status Openssl(std::vector<std::string> args) {
  args.insert(args.begin(), "/usr/bin/openssl");
  RunResult r = RunCommand(args, absl::Seconds(30));
  if (r.exit_code != 0) {
    return absl::UnavailableError(absl::StrCat("openssl ", args[1], " failed (", r.exit_code, "): ", r.err));
  }
  return absl::OkStatus();
}

// A P-256 key and a certificate signed by `ca` (self-signed when `ca` is empty).
absl::Status Issue(const std::string& dir, const std::string& name, const std::string& subject,
                   const std::string& extensions, const std::string& ca) {
  const std::string key = absl::StrCat(dir, "/", name, ".key"), pem = absl::StrCat(dir, "/", name, ".pem");
  if (ca.empty()) {
    absl::Status s = Openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                              "-keyout", key, "-out", pem, "-days", "2", "-subj", subject});
    if (!s.ok()) return s;
  } else {
    const std::string csr = absl::StrCat(dir, "/", name, ".csr"), ext = absl::StrCat(dir, "/", name, ".ext");
    std::ofstream(ext) << extensions << "\n";
    absl::Status s = Openssl({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
                              key, "-out", csr, "-subj", subject});
    if (!s.ok()) return s;
    s = Openssl({"x509", "-req", "-in", csr, "-CA", absl::StrCat(dir, "/", ca, ".pem"), "-CAkey",
                 absl::StrCat(dir, "/", ca, ".key"), "-CAcreateserial", "-out", pem, "-days", "2", "-extfile", ext});
    if (!s.ok()) return s;
  }
  chmod(key.c_str(), 0600);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CertSet> MakeCertificates(const std::string& dir) {
  const std::string server_ext = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth";
  for (absl::Status s : {Issue(dir, "ca", "/CN=shardcoord test CA", "", ""),
                         Issue(dir, "server", "/CN=localhost", server_ext, "ca"),
                         Issue(dir, "client", "/CN=rank", "extendedKeyUsage=clientAuth", "ca"),
                         Issue(dir, "other-ca", "/CN=another CA", "", ""),
                         Issue(dir, "other-server", "/CN=localhost", server_ext, "other-ca")}) {
    if (!s.ok()) return s;
  }
  auto f = [&](const char* name) { return absl::StrCat(dir, "/", name); };
  return CertSet{f("ca.pem"),       f("server.pem"),       f("server.key"),      f("client.pem"),
                 f("client.key"),   f("other-ca.pem"),     f("other-server.pem"), f("other-server.key")};
}

}  // namespace shardcoord::testing
