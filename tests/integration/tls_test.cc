// TLS (DESIGN 13): the real server serving TLS on 127.0.0.1:0 with certificates made by the
// openssl CLI, real workers and raw gRPC clients over loopback.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <cstdio>
#include <fstream>

#include "coordinator/server/tls.h"
#include "integration/inprocess_fixture.h"
#include "shardcoord/channel_credentials.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"
#include "support/certs.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

// TlsFiles from its fields in order, the ones not given empty (brace initialization leaves
// -Wmissing-field-initializers warnings).
TlsFiles Tls(std::string ca = "", std::string cert = "", std::string key = "", std::string name = "") {
  TlsFiles t;
  t.ca_file = std::move(ca);
  t.cert_file = std::move(cert);
  t.key_file = std::move(key);
  t.server_name = std::move(name);
  return t;
}


using ::testing::HasSubstr;

constexpr char kRankToken[] = "rank-token-0123456789abcdef";
constexpr char kReadToken[] = "read-token-0123456789abcdef";

class TlsTest : public InProcessTest {
 protected:
  void SetUp() override {
    auto certs = testing::MakeCertificates(dir_.path());
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = *certs;
    tokens_ = dir_.File("tokens");
    std::ofstream(tokens_) << "rank " << kRankToken << "\nread " << kReadToken << "\n";
    ASSERT_EQ(chmod(tokens_.c_str(), 0600), 0);
  }

  coordinator::CoordinatorOptions Secured(bool mutual = false) const {
    coordinator::CoordinatorOptions o;
    o.token_file = tokens_;
    o.tls.cert_file = certs_.server_cert;
    o.tls.key_file = certs_.server_key;
    if (mutual) o.tls.client_ca_file = certs_.ca;
    return o;
  }

  WorkerOptions RankOptions(int rank, TlsFiles tls) {
    WorkerOptions o = Options(rank, 2, 2);
    o.token = kRankToken;
    o.tls = std::move(tls);
    o.connect_timeout = absl::Seconds(3);
    o.reconnect_window = absl::ZeroDuration();
    return o;
  }

  // GetStatus as an operator would make it, over `tls` (plaintext when it has no CA).
  absl::Status Query(const TlsFiles& tls, const std::string& token = kReadToken) {
    grpc::ChannelArguments args;
    auto creds = ChannelCredentialsFor(tls, args);
    if (!creds.ok()) return creds.status();
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(server_->address(), *creds, args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::StatusResponse resp;
    return FromGrpcStatus(stub->GetStatus(&ctx, v1::StatusRequest(), &resp));
  }

  // Both ranks decide (0, mb) and, the first time, all-reduce over Gloo: the job works.
  void RunMicrobatch(Worker& w0, Worker& w1, int mb) {
    ASSERT_NO_FATAL_FAILURE(DecideTogether(w0, w1, mb));
    if (mb > 0) return;
    int64_t a = 2, b = 3;
    AllReduceOnWorld(w0, w1, &a, &b, ReduceOp::kSum);
    EXPECT_EQ(a, 5);
  }

  testing::TempDir dir_;
  testing::CertSet certs_;
  std::string tokens_;
};

TEST_F(TlsTest, AJobRunsOverTlsAndNothingElseIsServed) {
  StartServer(Secured());
  const TlsFiles tls = Tls(certs_.ca);
  auto w0 = Connect(RankOptions(0, tls));
  auto w1 = Connect(RankOptions(1, tls));
  ASSERT_TRUE(w0 && w1);
  RunMicrobatch(*w0, *w1, 0);
  // Plaintext with the right token: no connection forms, and the worker says what to try.
  EXPECT_EQ(Query(Tls()).code(), absl::StatusCode::kUnavailable);
  auto plain = Worker::Connect(RankOptions(0, Tls()));
  ASSERT_FALSE(plain.ok());
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(plain.status().message(), HasSubstr("If it serves TLS, give the CA file"));
  // A CA that did not sign the daemon's certificate: refused (no man in the middle either way).
  EXPECT_EQ(Query(Tls(certs_.other_ca)).code(), absl::StatusCode::kUnavailable);
  // The right CA but a name the certificate does not carry.
  EXPECT_EQ(Query(Tls(certs_.ca, "", "", "coordinator.example")).code(), absl::StatusCode::kUnavailable);
  // TLS and the right CA, but tokens still apply.
  EXPECT_TRUE(Query(tls).ok());
  EXPECT_EQ(Query(tls, kRankToken).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Query(tls, "wrong-token-0123456789abcdef").code(), absl::StatusCode::kUnauthenticated);
  // The job is unharmed.
  RunMicrobatch(*w0, *w1, 1);
}

TEST_F(TlsTest, MutualTlsServesOnlyCallersWithACertificateFromTheClientCa) {
  StartServer(Secured(/*mutual=*/true));
  const TlsFiles with_cert = Tls(certs_.ca, certs_.client_cert, certs_.client_key);
  auto w0 = Connect(RankOptions(0, with_cert));
  auto w1 = Connect(RankOptions(1, with_cert));
  ASSERT_TRUE(w0 && w1);
  RunMicrobatch(*w0, *w1, 0);
  EXPECT_EQ(Query(Tls(certs_.ca)).code(), absl::StatusCode::kUnavailable);
  // A certificate of another CA (a server certificate, here) is no client certificate of ours.
  EXPECT_EQ(Query(Tls(certs_.ca, certs_.other_server_cert, certs_.other_server_key)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Query(with_cert).ok());
  // A client certificate without its key is refused before dialling, saying so.
  absl::Status half = Query(Tls(certs_.ca, certs_.client_cert));
  EXPECT_EQ(half.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(half.message(), HasSubstr("needs its key"));
  RunMicrobatch(*w0, *w1, 1);
}

// A certificate renewed in place serves new connections without a restart; the sessions that
// were open go on.
TEST_F(TlsTest, ARenewedCertificateIsServedWithoutARestart) {
  coordinator::CoordinatorOptions o = Secured();
  const std::string cert = dir_.File("live.pem"), key = dir_.File("live.key");
  auto copy = [](const std::string& from, const std::string& to) { ASSERT_TRUE(testing::ReplaceFile(from, to)); };
  copy(certs_.server_cert, cert);
  copy(certs_.server_key, key);
  o.tls.cert_file = cert;
  o.tls.key_file = key;
  o.tls.reload_interval = absl::Seconds(1);
  StartServer(o);
  auto w0 = Connect(RankOptions(0, Tls(certs_.ca)));
  auto w1 = Connect(RankOptions(1, Tls(certs_.ca)));
  ASSERT_TRUE(w0 && w1);
  EXPECT_EQ(Query(Tls(certs_.other_ca)).code(), absl::StatusCode::kUnavailable);
  copy(certs_.other_server_key, key);
  copy(certs_.other_server_cert, cert);
  EXPECT_TRUE(testing::WaitUntil([&] { return Query(Tls(certs_.other_ca)).ok(); }, absl::Seconds(20)))
      << "the renewed certificate was not served";
  EXPECT_EQ(Query(Tls(certs_.ca)).code(), absl::StatusCode::kUnavailable);
  RunMicrobatch(*w0, *w1, 0);
}

// A copy of `cert` whose validity starts a day from now, signed again with `key`.
std::string NotYetValidCopy(const std::string& cert, const std::string& key, const std::string& out) {
  FILE* cf = std::fopen(cert.c_str(), "r");
  FILE* kf = std::fopen(key.c_str(), "r");
  X509* x = cf ? PEM_read_X509(cf, nullptr, nullptr, nullptr) : nullptr;
  EVP_PKEY* k = kf ? PEM_read_PrivateKey(kf, nullptr, nullptr, nullptr) : nullptr;
  if (cf) std::fclose(cf);
  if (kf) std::fclose(kf);
  if (x && k) {
    X509_gmtime_adj(X509_getm_notBefore(x), 24 * 3600);
    X509_gmtime_adj(X509_getm_notAfter(x), 48 * 3600);
    X509_sign(x, k, EVP_sha256());
    FILE* of = std::fopen(out.c_str(), "w");
    if (of) {
      PEM_write_X509(of, x);
      std::fclose(of);
    }
  }
  X509_free(x);
  EVP_PKEY_free(k);
  return out;
}

TEST_F(TlsTest, ANotYetValidCertificateIsRefusedAtStartAndAtRenewal) {
  // Issue 25: served, every client failed with only "certificate verify failed".
  const std::string future = NotYetValidCopy(certs_.server_cert, certs_.server_key, dir_.File("future.pem"));
  absl::Status s = coordinator::CheckTls({future, certs_.server_key});
  EXPECT_THAT(s.message(), HasSubstr("future.pem is not valid yet"));
  EXPECT_THAT(s.message(), HasSubstr("check this host's clock"));
  // As a renewal: refused, naming the configured file; the previous pair stays served.
  const std::string cert = dir_.File("live.pem"), key = dir_.File("live.key");
  ASSERT_TRUE(testing::ReplaceFile(certs_.server_cert, cert));
  ASSERT_TRUE(testing::ReplaceFile(certs_.server_key, key));
  auto copy = coordinator::TlsCopy::Start({cert, key});
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_TRUE(testing::ReplaceFile(future, cert));
  s = (*copy)->Refresh();
  EXPECT_THAT(s.message(), HasSubstr("live.pem is not valid yet"));
  EXPECT_EQ(testing::ReadFile((*copy)->served().cert_file), testing::ReadFile(certs_.server_cert))
      << "the previous certificate is still the one served";
}

TEST_F(TlsTest, ACertificateRenewedBeforeItsKeyKeepsThePreviousPairServing) {
  // Issue 25: a renewal writing the certificate first made every handshake fail until the
  // key came, and the self-check then took the listener for deaf and exited the daemon.
  coordinator::CoordinatorOptions o = Secured();
  const std::string cert = dir_.File("live.pem"), key = dir_.File("live.key");
  ASSERT_TRUE(testing::ReplaceFile(certs_.server_cert, cert));
  ASSERT_TRUE(testing::ReplaceFile(certs_.server_key, key));
  o.tls.cert_file = cert;
  o.tls.key_file = key;
  o.tls.reload_interval = absl::Seconds(1);
  o.limits.self_check_interval = absl::Milliseconds(200);
  StartServer(o);
  auto w0 = Connect(RankOptions(0, Tls(certs_.ca)));
  auto w1 = Connect(RankOptions(1, Tls(certs_.ca)));
  ASSERT_TRUE(w0 && w1);
  ASSERT_TRUE(testing::ReplaceFile(certs_.other_server_cert, cert));  // The key comes later.
  // Three reload intervals: every new connection is still served the previous pair.
  const absl::Time until = absl::Now() + absl::Seconds(3);
  int queries = 0;
  while (absl::Now() < until) {
    ASSERT_TRUE(Query(Tls(certs_.ca)).ok()) << "query " << queries;
    ++queries;
  }
  RunMicrobatch(*w0, *w1, 0);
  ASSERT_TRUE(testing::ReplaceFile(certs_.other_server_key, key));
  EXPECT_TRUE(testing::WaitUntil([&] { return Query(Tls(certs_.other_ca)).ok(); }, absl::Seconds(20)))
      << "the complete renewal was not served";
  RunMicrobatch(*w0, *w1, 1);
}

TEST_F(TlsTest, BadTlsSettingsAreRefusedBeforeServingNamingTheFile) {
  auto check = [](coordinator::TlsSettings t) { return coordinator::CheckTls(t); };
  coordinator::TlsSettings t{certs_.server_cert, certs_.other_server_key};
  EXPECT_THAT(check(t).message(), HasSubstr("does not belong to certificate"));
  t.key_file = certs_.server_key;
  EXPECT_TRUE(check(t).ok()) << check(t);
  ASSERT_EQ(chmod(certs_.server_key.c_str(), 0644), 0);
  EXPECT_THAT(check(t).message(), HasSubstr("chmod 600"));
  ASSERT_EQ(chmod(certs_.server_key.c_str(), 0600), 0);
  t.cert_file = dir_.File("missing.pem");
  EXPECT_THAT(check(t).message(), HasSubstr("missing.pem cannot be read"));
  t.cert_file = tokens_;
  EXPECT_THAT(check(t).message(), HasSubstr("holds no PEM certificate"));
  EXPECT_THAT(check({certs_.server_cert, ""}).message(), HasSubstr("needs both"));
  EXPECT_THAT(check({"", "", certs_.ca}).message(), HasSubstr("--tls-client-ca-file needs --tls-cert-file"));
  t = {certs_.server_cert, certs_.server_key, tokens_};
  EXPECT_THAT(check(t).message(), HasSubstr("client CA"));
  // Under mutual TLS the self-check presents the daemon's certificate, if the client CA takes it.
  EXPECT_TRUE(coordinator::ServerCertificateIsAClient({certs_.server_cert, certs_.server_key, certs_.ca}));
  EXPECT_FALSE(coordinator::ServerCertificateIsAClient({certs_.server_cert, certs_.server_key, certs_.other_ca}));
  // The server refuses to start with them.
  coordinator::CoordinatorOptions o = Secured();
  o.listen_address = "127.0.0.1:0";
  o.tls.key_file = certs_.other_server_key;
  EXPECT_FALSE(coordinator::CoordinatorServer::Start(o).ok());
  // Off loopback, TLS and tokens are both required unless --insecure.
  o = Secured();
  o.listen_address = "0.0.0.0:0";
  EXPECT_TRUE(coordinator::ValidateOptions(o).ok());
  o.tls = {};
  EXPECT_THAT(coordinator::ValidateOptions(o).message(), HasSubstr("without TLS the tokens travel in clear text"));
  o.insecure = true;
  EXPECT_TRUE(coordinator::ValidateOptions(o).ok());
}

// The self-check (which exits a deaf daemon) must count a refused token or a refused
// handshake as an answer: a secured daemon stays up.
TEST_F(TlsTest, TheSelfCheckOfASecuredDaemonDoesNotMistakeARefusalForADeafListener) {
  for (bool mutual : {false, true}) {
    coordinator::CoordinatorOptions o = Secured(mutual);
    o.listen_address = "127.0.0.1:0";
    o.limits.self_check_interval = absl::Milliseconds(50);
    std::atomic<bool> lost{false};
    auto s = coordinator::CoordinatorServer::Start(o, nullptr, [&](const std::string&) { lost = true; });
    ASSERT_TRUE(s.ok()) << s.status();
    // Three failed checks (150 ms) would report the listener lost; allow ten times that.
    absl::SleepFor(absl::Milliseconds(1500));
    EXPECT_FALSE(lost.load()) << (mutual ? "mutual TLS" : "TLS");
  }
}

}  // namespace
}  // namespace shardcoord
