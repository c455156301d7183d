// The daemon's HTTP listener (http_server.h): real server on 127.0.0.1:0, real workers, and
// cpp-httplib's client over loopback. /metrics is read by a strict text-format parser and
// checked against the same numbers over gRPC (what `shardctl --json` prints).
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#define CPPHTTPLIB_OPENSSL_SUPPORT  // httplib::SSLClient for the HTTPS checks (Debian's library has it).
#include <dirent.h>
#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <thread>

#include <fstream>
#include <map>
#include <cstring>
#include <regex>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "coordinator/ops/metrics.h"
#include "coordinator/ops/status_page.h"
#include "coordinator/server/http_server.h"
#include "integration/inprocess_fixture.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"
#include "support/certs.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

using ::testing::HasSubstr;

// One sample of the Prometheus text format: name, labels, value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses the text exposition format 0.0.4 strictly; a malformed line is a test failure.
std::vector<Sample> ParseMetrics(const std::string& text) {
  static const std::regex kSample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$)");
  static const std::regex kLabel(R"re(^([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"$)re");
  std::map<std::string, std::string> types;
  std::vector<Sample> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const std::string l(line);
    if (l.rfind("# HELP ", 0) == 0) continue;
    if (l.rfind("# TYPE ", 0) == 0) {
      std::vector<std::string> f = absl::StrSplit(l.substr(7), ' ');
      EXPECT_EQ(f.size(), 2u) << l;
      EXPECT_TRUE(f[1] == "counter" || f[1] == "gauge" || f[1] == "histogram") << l;
      EXPECT_TRUE(types.emplace(f[0], f[1]).second) << "TYPE twice: " << l;
      continue;
    }
    std::smatch m;
    if (!std::regex_match(l, m, kSample)) {
      ADD_FAILURE() << "not a sample line: " << l;
      continue;
    }
    Sample s{m[1], {}, std::stod(m[4])};
    EXPECT_TRUE(s.name.rfind("shardcoord_", 0) == 0 || s.name.rfind("process_", 0) == 0) << l;
    auto type = types.find(s.name);
    for (const char* part : {"_bucket", "_sum", "_count"}) {  // A histogram's samples.
      if (type == types.end() && absl::EndsWith(s.name, part)) {
        type = types.find(s.name.substr(0, s.name.size() - strlen(part)));
        if (type != types.end() && type->second != "histogram") type = types.end();
      }
    }
    EXPECT_NE(type, types.end()) << "sample before its TYPE: " << l;
    if (type != types.end() && type->second == "counter") {
      EXPECT_TRUE(absl::EndsWith(s.name, "_total")) << "counter without _total: " << l;
    }
    if (m[3].matched && !m[3].str().empty()) {
      for (absl::string_view pair : absl::StrSplit(m[3].str(), absl::ByString("\","))) {
        std::string p(pair);
        if (p.back() != '"') p += '"';
        std::smatch lm;
        if (!std::regex_match(p, lm, kLabel)) {
          ADD_FAILURE() << "bad label " << p << " in " << l;
          continue;
        }
        s.labels[lm[1]] = lm[2];
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

double Value(const std::vector<Sample>& samples, const std::string& name,
             const std::map<std::string, std::string>& labels) {
  for (const auto& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) match = match && s.labels.count(k) && s.labels.at(k) == v;
    if (match) return s.value;
  }
  ADD_FAILURE() << "no sample " << name;
  return -1;
}

class HttpTest : public InProcessTest {
 protected:
  void SetUp() override {}
  void StartWithHttp(coordinator::CoordinatorOptions o = {}) {
    o.http_listen = "127.0.0.1:0";
    StartServer(o);
    const std::string addr = server_->http_address();
    ASSERT_FALSE(addr.empty());
    client_ = std::make_unique<httplib::Client>("127.0.0.1", std::stoi(addr.substr(addr.rfind(':') + 1)));
    client_->set_read_timeout(10, 0);
    client_->set_connection_timeout(10, 0);
  }
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(HttpTest, MetricsParseStrictlyAndMatchTheGrpcStatusAndThePageShowsTheJob) {
  StartWithHttp();
  auto w0 = Connect(Options(0, 2, 2));
  auto w1 = Connect(Options(1, 2, 2));
  ASSERT_TRUE(w0 && w1);
  for (int mb = 0; mb < 3; ++mb) {  // Uniform, divergent (fallback root), all-zero (skip).
    ASSERT_TRUE(w0->ReportPlan(PlanOf(0, mb, mb == 2 ? 0 : 1)).ok());
    ASSERT_TRUE(w1->ReportPlan(PlanOf(0, mb, mb == 0 ? 1 : 0)).ok());
    ASSERT_TRUE(w0->GetDecision({0, mb}, kDecisionTimeout).ok());
    ASSERT_TRUE(w1->GetDecision({0, mb}, kDecisionTimeout).ok());
  }
  auto health = client_->Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok\n");

  auto metrics = client_->Get("/metrics");
  ASSERT_TRUE(metrics);
  ASSERT_EQ(metrics->status, 200);
  EXPECT_THAT(metrics->get_header_value("Content-Type"), HasSubstr("text/plain; version=0.0.4"));
  const auto samples = ParseMetrics(metrics->body);
  const auto groups = server_->core().Groups("job");
  ASSERT_EQ(groups.groups_size(), 1);
  for (const auto& [module, c] : groups.groups(0).module_counts()) {
    for (const auto& [kind, n] : std::vector<std::pair<std::string, int64_t>>{
             {"per_layer", c.per_layer()}, {"skip", c.skip()}, {"root", c.root()}, {"replicate", c.replicate()}}) {
      EXPECT_EQ(Value(samples, "shardcoord_module_decisions_total",
                      {{"job_id", "job"}, {"module", module}, {"decision", kind}}),
                n)
          << module << " " << kind;
    }
  }
  const auto& c = groups.groups(0).counts();
  EXPECT_GT(c.per_layer() + c.skip() + c.root(), 0);
  // The audio tower is called by nobody: skipped three times; the vision tower never skipped.
  EXPECT_EQ(Value(samples, "shardcoord_module_decisions_total",
                  {{"job_id", "job"}, {"module", "audio_tower"}, {"decision", "skip"}}), 3);
  EXPECT_EQ(Value(samples, "shardcoord_module_decisions_total",
                  {{"job_id", "job"}, {"module", "vision_tower"}, {"decision", "root"}}), 1);
  EXPECT_EQ(Value(samples, "shardcoord_ranks", {{"job_id", "job"}, {"state", "live"}}), 2);
  EXPECT_EQ(Value(samples, "shardcoord_groups", {{"job_id", "job"}, {"state", "failed"}}), 0);  // Present at zero.
  EXPECT_EQ(Value(samples, "shardcoord_group_epoch", {{"job_id", "job"}, {"group", "0"}}), 0);  // A small job: per group.
  EXPECT_EQ(Value(samples, "shardcoord_pending_microbatches", {{"job_id", "job"}}), 0);
  EXPECT_EQ(Value(samples, "shardcoord_microbatches_decided_total", {{"job_id", "job"}}), 3);
  EXPECT_EQ(Value(samples, "shardcoord_events_total", {{"kind", "rank_registered"}}), 2);
  EXPECT_EQ(Value(samples, "shardcoord_events_total", {{"kind", "rank_dead"}}), 0);
  EXPECT_EQ(Value(samples, "shardcoord_decision_latency_seconds_count", {}), 3);
  EXPECT_GT(Value(samples, "process_open_fds", {}), 0);
  for (const auto& s : samples) EXPECT_EQ(s.labels.count("job"), 0u) << s.name << ": `job` is Prometheus' label";
  EXPECT_EQ(Value(samples, "shardcoord_build_info", {}), 1);

  auto page = client_->Get("/");
  ASSERT_TRUE(page);
  ASSERT_EQ(page->status, 200);
  EXPECT_THAT(page->body, HasSubstr("<section class=job data-job='job'>"));
  EXPECT_THAT(page->body, HasSubstr("data-rank=1 data-state=live"));
  EXPECT_THAT(page->body, HasSubstr("http-equiv=refresh"));
  EXPECT_THAT(page->body, ::testing::Not(HasSubstr("<script")));
}

// Live jobs come first and a finished one is a collapsed line: here the finished job was
// registered first and its id sorts first (the coordinator lists jobs by id), so only the
// page's own ordering puts the live job above it.
TEST_F(HttpTest, ThePageShowsLiveJobsFirstAndCollapsesFinishedOnes) {
  StartWithHttp();
  const std::string done_job = "aa-finished-job-with-a-long-id", live_job = "zz-live-job";
  auto done = Connect(Options(0, 1, 1, Policy::kAuto, done_job));
  ASSERT_TRUE(done);
  done->Close();
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        const auto s = server_->core().Status(done_job);
        return s.jobs_size() == 1 && s.jobs(0).ranks_left() == 1;
      },
      testing::kLoadSlack));
  auto live = Connect(Options(0, 1, 1, Policy::kAuto, live_job));
  ASSERT_TRUE(live);
  ASSERT_TRUE(testing::WaitUntil([&] { return server_->core().Status(live_job).jobs(0).ranks_live() == 1; },
                                 testing::kLoadSlack));

  auto page = client_->Get("/");
  ASSERT_TRUE(page);
  ASSERT_EQ(page->status, 200);
  const std::string& body = page->body;
  const size_t live_at = body.find("<section class=job data-job='" + live_job + "'>");
  const size_t done_at = body.find("data-job='" + done_job + "'");
  ASSERT_NE(live_at, std::string::npos) << body;
  ASSERT_NE(done_at, std::string::npos) << body;
  EXPECT_LT(live_at, done_at) << "the live job's section must come before the finished job's";
  EXPECT_THAT(body, HasSubstr("<p class=finished data-job='" + done_job + "'><a href='/?job=" + done_job +
                              "'><b>Job " + done_job + "</b></a> &middot; finished: 1 left"));
  EXPECT_THAT(body, ::testing::Not(HasSubstr("<section class=job data-job='" + done_job + "'>")));
  // The finished job's own page (the link) has it in full, and only it.
  auto own = client_->Get("/?job=" + done_job);
  ASSERT_TRUE(own);
  ASSERT_EQ(own->status, 200);
  EXPECT_THAT(own->body, HasSubstr("<section class=job data-job='" + done_job + "'>"));
  EXPECT_THAT(own->body, ::testing::Not(HasSubstr("data-job='" + live_job + "'")));
  EXPECT_THAT(own->body, HasSubstr("<a href='/'>&larr; every job</a>"));
  // A job id that needs escaping in a URL and on the page comes back as itself.
  EXPECT_EQ(coordinator::UrlDecode(coordinator::UrlEncode("a b&c'<d>%")), "a b&c'<d>%");
  EXPECT_EQ(coordinator::UrlDecode("%zz%4"), "%zz%4");  // Malformed escapes are kept.
  auto unknown = client_->Get("/?job=%3Cscript%3E");
  ASSERT_TRUE(unknown);
  EXPECT_THAT(unknown->body, HasSubstr("No job '&lt;script&gt;' here."));
}

// Whether the peer closed the connection (EOF or reset) within `timeout`; any bytes it sent
// before are appended to *got.
bool ClosedWithin(int fd, absl::Duration timeout, std::string* got = nullptr) {
  const absl::Time deadline = absl::Now() + timeout;
  char buf[4096];
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;
    if (got) got->append(buf, static_cast<size_t>(n));
  }
  return false;
}

bool StillOpen(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) == 0;  // Nothing to read and no hang-up.
}

int OpenDescriptors() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

int PortOf(const std::string& address) { return std::stoi(address.substr(address.rfind(':') + 1)); }

TEST_F(HttpTest, BadRequestsAreRefusedAndTheServerGoesOn) {
  StartWithHttp();
  auto missing = client_->Get("/no/such/page");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_THAT(missing->body, HasSubstr("try /, /metrics or /healthz"));
  // Refused: a 4xx, or the connection closed before the client finished sending.
  auto huge = client_->Get("/metrics?" + std::string(64 << 10, 'x'));
  if (huge) {
    EXPECT_EQ(huge->status, 431);
  }
  // The server answers before reading the body and closes: the client's write may meet a closed
  // socket (EPIPE, not a signal that kills the test).
  signal(SIGPIPE, SIG_IGN);
  auto post = client_->Post("/metrics", std::string(1 << 20, 'y'), "text/plain");
  if (post) {
    EXPECT_TRUE(post->status == 405 || post->status == 413) << post->status;
  }
  auto head = client_->Head("/healthz");
  ASSERT_TRUE(head);
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->get_header_value("Content-Length"), "3");
  // Header lines past 16 KiB: 431, and the server reads no more of them.
  const int fd = testing::ConnectLoopback(PortOf(server_->http_address()));
  ASSERT_GE(fd, 0);
  std::string request = "GET /healthz HTTP/1.1\r\nHost: x\r\n";
  while (request.size() < (17 << 10)) request += "X-Padding: " + std::string(100, 'p') + "\r\n";
  request += "\r\n";
  ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  std::string got;
  EXPECT_TRUE(ClosedWithin(fd, absl::Seconds(10), &got));
  EXPECT_THAT(got, HasSubstr("431"));
  close(fd);
  // Bytes that are no HTTP request: a 400 that says so (they were closed without a status line).
  const int garbage = testing::ConnectLoopback(PortOf(server_->http_address()));
  ASSERT_GE(garbage, 0);
  const std::string junk = "GET / HTTP/9.9 nonsense\r\n\r\n";
  ASSERT_EQ(send(garbage, junk.data(), junk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(junk.size()));
  std::string said;
  EXPECT_TRUE(ClosedWithin(garbage, absl::Seconds(10), &said));
  EXPECT_THAT(said, HasSubstr("400"));
  EXPECT_THAT(said, HasSubstr("malformed HTTP request"));
  close(garbage);
  // /?job=%00 was put into the page.
  auto nul = client_->Get("/?job=%00x");
  ASSERT_TRUE(nul);
  EXPECT_EQ(nul->status, 400);
  EXPECT_THAT(nul->body, HasSubstr("is no job id"));
  auto health = client_->Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// The review's slowloris and idle connections: they held all four threads of the old listener,
// and /healthz (the liveness probe) went unanswered while they did.
TEST_F(HttpTest, IdleAndSlowClientsHoldNoThreadAndAreCutAtTheDeadline) {
  coordinator::CoordinatorOptions o;
  o.http_request_timeout = absl::Seconds(3);
  StartWithHttp(o);
  const int port = PortOf(server_->http_address());
  std::vector<int> idle;
  for (int i = 0; i < 12; ++i) idle.push_back(testing::ConnectLoopback(port));
  const int slow = testing::ConnectLoopback(port);
  ASSERT_GE(slow, 0);
  const std::string start = "GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ";
  ASSERT_GT(send(slow, start.data(), start.size(), MSG_NOSIGNAL), 0);
  std::atomic<bool> stop{false};
  std::thread drip([&] {  // One header byte every 100 ms, never the end of the headers.
    while (!stop.load() && send(slow, "a", 1, MSG_NOSIGNAL) == 1) absl::SleepFor(absl::Milliseconds(100));
  });
  for (int fd : idle) ASSERT_GE(fd, 0);
  auto health = client_->Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto metrics = client_->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  int held = 0;  // Answered while the idle ones were still held (the deadline is 3 s).
  for (int fd : idle) held += StillOpen(fd);
  EXPECT_GT(held, 0);
  for (int fd : idle) EXPECT_TRUE(ClosedWithin(fd, absl::Seconds(15)));
  EXPECT_TRUE(ClosedWithin(slow, absl::Seconds(15))) << "the slow client was not cut at the deadline";
  stop = true;
  drip.join();
  for (int fd : idle) close(fd);
  close(slow);
}

// Idle connections used to pile up until the daemon ran out of descriptors and exited.
TEST_F(HttpTest, IdleConnectionsAtTheLimitMakeRoomAndDescriptorsStayBounded) {
  // The probe: 64 idle connections, reopened as the daemon closed them, kept /healthz, / and
  // /metrics at 0 answers of 60 for 30 s. At the limit, the oldest connection that has sent no
  // request makes room for the new one.
  coordinator::CoordinatorOptions o;
  o.http_max_connections = 4;
  o.http_request_timeout = absl::Seconds(60);
  StartWithHttp(o);
  const int port = PortOf(server_->http_address());
  const int before = OpenDescriptors();
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(testing::ConnectLoopback(port));
  for (int fd : idle) ASSERT_GE(fd, 0);
  // Answered while the idle ones stay open: once the held ones are old enough to be evicted
  // (200 ms: a burst of new connections does not push out clients about to speak).
  for (const char* path : {"/healthz", "/metrics", "/healthz"}) {
    EXPECT_TRUE(testing::WaitUntil(
        [&] {
          auto r = client_->Get(path);
          return r && r->status == 200;
        },
        absl::Seconds(10), absl::Milliseconds(20)))
        << path;
  }
  EXPECT_TRUE(ClosedWithin(idle.front(), absl::Seconds(10))) << "the oldest idle connection made room";
  // This process holds both ends: 64 client sockets, and at most the limit (and the ones being
  // closed) on the server's side.
  EXPECT_LE(OpenDescriptors() - before, 64 + 4 + 4);
  for (int fd : idle) close(fd);
}

// The probe's 64 idle connections came from one address: at its own limit, a client's oldest
// idle connection makes room for its next one, and other addresses keep theirs.
TEST_F(HttpTest, OneClientAddressHoldsAtMostItsShareAndOthersKeepTheirs) {
  coordinator::CoordinatorOptions o;
  o.http_max_connections = 64;
  o.http_max_connections_per_client = 4;
  o.http_request_timeout = absl::Seconds(60);
  StartWithHttp(o);
  const int port = PortOf(server_->http_address());
  std::vector<int> others;  // Another host's idle connections, held first.
  for (int i = 0; i < 4; ++i) others.push_back(testing::ConnectLoopback(port, "127.0.0.3"));
  for (int fd : others) ASSERT_GE(fd, 0) << "cannot connect from 127.0.0.3";
  std::vector<int> flood;
  for (int round = 0; round < 3; ++round) {  // Reopened as they are closed, past the 200 ms grace.
    for (int i = 0; i < 20; ++i) flood.push_back(testing::ConnectLoopback(port, "127.0.0.2"));
    absl::SleepFor(absl::Milliseconds(250));  // Age only: what is checked below waits on events.
  }
  for (int fd : flood) ASSERT_GE(fd, 0);
  auto open_of = [](const std::vector<int>& fds) {
    int n = 0;
    for (int fd : fds) n += StillOpen(fd);
    return n;
  };
  EXPECT_TRUE(testing::WaitUntil([&] { return open_of(flood) <= 4; }, absl::Seconds(10), absl::Milliseconds(20)))
      << open_of(flood) << " of the flooding address's connections still open; its limit is 4";
  EXPECT_EQ(open_of(others), 4) << "another address's connections were taken for the flood";
  auto health = client_->Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  for (int fd : flood) close(fd);
  for (int fd : others) close(fd);
}

// The page and /metrics are made on a thread of their own: a render that takes long (a 6 s
// /metrics did) or many waiting for theirs do not hold /healthz up.
TEST_F(HttpTest, HealthIsAnsweredWhileThePagesAreBeingMade) {
  StartWithHttp();
  absl::Notification release;
  absl::Notification rendering;
  server_->http_for_testing()->RunOnRenderThreadForTesting([&] {
    rendering.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(30));  // Never forever, even if the test fails.
  });
  ASSERT_TRUE(rendering.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const std::string addr = server_->http_address();
  std::vector<std::thread> pages;
  std::atomic<int> pages_ok{0};
  for (int i = 0; i < 4; ++i) {
    pages.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", PortOf(addr));
      c.set_read_timeout(20, 0);
      auto r = c.Get(i % 2 == 0 ? "/metrics" : "/");
      if (r && r->status == 200) ++pages_ok;
    });
  }
  auto health = client_->Get("/healthz");  // While every page waits for the render thread.
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(pages_ok.load(), 0) << "a page was made while the render thread was held";
  release.Notify();
  for (auto& t : pages) t.join();
  EXPECT_EQ(pages_ok.load(), 4) << "the pages are made once the render thread is free";
}

// HTTPS serves the daemon's certificate and, like gRPC, takes a renewed one without a restart;
// a renewal caught half-written (a key that does not match) keeps the previous pair serving.
TEST_F(HttpTest, HttpsReloadsARenewedCertificateAndKeepsServingThroughAHalfWrittenOne) {
  testing::TempDir dir;
  auto certs = testing::MakeCertificates(dir.path());
  if (!certs.ok()) GTEST_SKIP() << certs.status();
  const std::string cert = dir.path() + "/tls.crt", key = dir.path() + "/tls.key";
  ASSERT_TRUE(testing::ReplaceFile(certs->server_cert, cert));
  ASSERT_TRUE(testing::ReplaceFile(certs->server_key, key));
  coordinator::CoordinatorOptions o;
  o.tls.cert_file = cert;
  o.tls.key_file = key;
  o.tls.reload_interval = absl::Seconds(1);
  o.http_listen = "127.0.0.1:0";
  StartServer(o);
  const int port = PortOf(server_->http_address());
  auto get = [&](const std::string& ca) {
    httplib::SSLClient c("127.0.0.1", port);
    c.set_ca_cert_path(ca.c_str());
    c.enable_server_certificate_verification(true);
    c.set_connection_timeout(10, 0);
    c.set_read_timeout(10, 0);
    auto r = c.Get("/healthz");
    return r ? r->status : -1;
  };
  EXPECT_EQ(get(certs->ca), 200);
  EXPECT_EQ(get(certs->other_ca), -1);  // Not the CA that signed it.
  // Half-written renewal: the other certificate with the old key.
  ASSERT_TRUE(testing::ReplaceFile(certs->other_server_cert, cert));
  absl::SleepFor(absl::Milliseconds(1100));  // Past the reload interval: the next handshake checks.
  EXPECT_EQ(get(certs->ca), 200) << "the mismatched pair replaced the serving one";
  // Completed: served from the next check on.
  ASSERT_TRUE(testing::ReplaceFile(certs->other_server_key, key));
  EXPECT_TRUE(testing::WaitUntil([&] { return get(certs->other_ca) == 200; }, absl::Seconds(20),
                                 absl::Milliseconds(200)))
      << "the renewed certificate was not served";
}

TEST_F(HttpTest, WithTokensThePageAndMetricsNeedAReadTokenAndHealthDoesNot) {
  testing::TempDir dir;
  const std::string tokens = dir.File("tokens");
  std::ofstream(tokens) << "read read-token-0123456789abcdef\nrank rank-token-0123456789abcdef\n"
                        << "read other-job-reader-0123456789 job=other\n";
  ASSERT_EQ(chmod(tokens.c_str(), 0600), 0);
  coordinator::CoordinatorOptions o;
  o.token_file = tokens;
  StartWithHttp(o);
  auto anonymous = client_->Get("/metrics");
  ASSERT_TRUE(anonymous);
  EXPECT_EQ(anonymous->status, 401);
  EXPECT_THAT(anonymous->get_header_value("WWW-Authenticate"), HasSubstr("Basic"));
  auto as_rank = client_->Get("/", {{"Authorization", "Bearer rank-token-0123456789abcdef"}});
  ASSERT_TRUE(as_rank);
  EXPECT_EQ(as_rank->status, 401);
  auto bearer = client_->Get("/metrics", {{"Authorization", "Bearer read-token-0123456789abcdef"}});
  ASSERT_TRUE(bearer);
  EXPECT_EQ(bearer->status, 200);
  const std::string basic = "Basic " + absl::Base64Escape("operator:read-token-0123456789abcdef");
  auto browser = client_->Get("/", {{"Authorization", basic}});
  ASSERT_TRUE(browser);
  EXPECT_EQ(browser->status, 200);
  auto health = client_->Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  // A reader limited to another job sees none of this one, on the page or in the metrics.
  WorkerOptions wo = Options(0, 1, 1);
  wo.token = "rank-token-0123456789abcdef";
  auto w = Connect(wo);
  ASSERT_TRUE(w);
  const httplib::Headers other = {{"Authorization", "Bearer other-job-reader-0123456789"}};
  auto page = client_->Get("/", other);
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_THAT(page->body, ::testing::Not(HasSubstr("data-job='job'")));
  auto metrics = client_->Get("/metrics", other);
  ASSERT_TRUE(metrics);
  EXPECT_THAT(metrics->body, ::testing::Not(HasSubstr("job_id=\"job\"")));
  EXPECT_THAT(metrics->body, HasSubstr("shardcoord_build_info"));
  for (const char* daemon_wide : {"shardcoord_events_total", "process_open_fds", "shardcoord_buffered_bytes",
                                  "shardcoord_decision_latency_seconds"}) {
    EXPECT_THAT(metrics->body, ::testing::Not(HasSubstr(daemon_wide))) << "a reader of one job sees all jobs' "
                                                                       << daemon_wide;
  }
  auto all = client_->Get("/", {{"Authorization", "Bearer read-token-0123456789abcdef"}});
  ASSERT_TRUE(all);
  EXPECT_THAT(all->body, HasSubstr("data-job='job'"));
  auto all_metrics = client_->Get("/metrics", {{"Authorization", "Bearer read-token-0123456789abcdef"}});
  ASSERT_TRUE(all_metrics);
  EXPECT_THAT(all_metrics->body, HasSubstr("job_id=\"job\""));
}

TEST(StatusPageTest, AHugeJobGivesABoundedPageWithTheDeadFirst) {
  // 65,536 ranks in one group made an 11.7 MB page (and four readers slowed the job 3x).
  constexpr int kWorld = 65536;
  coordinator::PageInput in;
  auto* job = in.snapshot.status.add_jobs();
  job->set_job_id("big");
  job->set_world_size(kWorld);
  auto* g = in.snapshot.groups.add_groups();
  g->set_job_id("big");
  for (int i = 0; i < kWorld; ++i) {
    g->add_ranks(i);
    auto* r = in.snapshot.ranks.add_ranks();
    r->set_job_id("big");
    r->set_rank(i);
    r->set_state(i == 60000 ? v1::RANK_STATE_DEAD : v1::RANK_STATE_LIVE);
    r->set_host("node-" + std::to_string(i / 8));
  }
  const std::string page = coordinator::StatusPage(in);
  EXPECT_LT(page.size(), 128u * 1024) << "the page must not grow with the job";
  EXPECT_THAT(page, HasSubstr("data-rank=60000"));  // The dead rank is shown, first.
  EXPECT_LT(page.find("data-rank=60000"), page.find("data-rank=0 ")) << "the dead come first";
  EXPECT_THAT(page, HasSubstr("65280 more ranks not shown"));
  EXPECT_THAT(page, HasSubstr("... (65504 more)"));  // The group's rank list.
}

TEST(MetricsTextTest, ClientChosenModuleAndCommunicatorNamesGiveABoundedNumberOfSeries) {
  // 100 one-rank jobs of 1024 modules made an 821,913-series, 430 MB answer.
  coordinator::Snapshot in;
  in.labels_max = 100;
  for (int j = 0; j < 20; ++j) {
    const std::string job = absl::StrCat("job-", j);
    auto* status = in.status.add_jobs();
    status->set_job_id(job);
    status->set_world_size(1);
    auto* g = in.groups.add_groups();
    g->set_job_id(job);
    for (int m = 0; m < 50; ++m) {
      (*g->mutable_module_counts())[absl::StrCat("module-", m)].set_per_layer(1);
      auto* c = in.comms.add_comms();
      c->set_job_id(job);
      c->set_name(absl::StrCat("comm-", m));
      c->set_epochs_aborted(1);
    }
  }
  const auto samples = ParseMetrics(coordinator::MetricsText(in));
  std::set<std::pair<std::string, std::string>> modules, comms;
  double per_layer = 0, aborts = 0;
  std::map<std::string, double> folded;
  for (const auto& s : samples) {
    if (s.name == "shardcoord_module_decisions_total" && s.labels.at("decision") == "per_layer") {
      modules.insert({s.labels.at("job_id"), s.labels.at("module")});
      per_layer += s.value;
    }
    if (s.name == "shardcoord_communicator_aborts_total") {
      comms.insert({s.labels.at("job_id"), s.labels.at("comm")});
      aborts += s.value;
    }
    if (s.name == "shardcoord_metrics_folded_labels") folded[s.labels.at("kind")] = s.value;
  }
  // 100 pairs of their own (two jobs' 50), and one "_other" for each of the 18 other jobs.
  EXPECT_EQ(modules.size(), 100u + 18u);
  EXPECT_EQ(comms.size(), 100u + 18u);
  EXPECT_TRUE(modules.count({"job-19", "_other"}));
  EXPECT_EQ(per_layer, 20 * 50) << "folded, not dropped: the sums are whole";
  EXPECT_EQ(aborts, 20 * 50);
  EXPECT_EQ(folded["module"], 900);
  EXPECT_EQ(folded["comm"], 900);
}

TEST(StatusPageTest, ManyLiveJobsGiveABoundedPage) {
  // 200 live jobs made a 16 MB page (2.6 s; /healthz waited 4-5 s behind it).
  coordinator::PageInput in;
  for (int j = 0; j < 200; ++j) {
    auto* job = in.snapshot.status.add_jobs();
    job->set_job_id(absl::StrCat("job-", j));
    job->set_world_size(256);
    job->set_ranks_live(256);
    auto* g = in.snapshot.groups.add_groups();
    g->set_job_id(job->job_id());
    for (int r = 0; r < 256; ++r) {
      g->add_ranks(r);
      auto* rank = in.snapshot.ranks.add_ranks();
      rank->set_job_id(job->job_id());
      rank->set_rank(r);
      rank->set_state(v1::RANK_STATE_LIVE);
    }
  }
  const std::string page = coordinator::StatusPage(in);
  EXPECT_LT(page.size(), 2u << 20) << "bounded per page, not only per job";
  EXPECT_THAT(page, HasSubstr("More live jobs"));
  EXPECT_THAT(page, HasSubstr("href='/?job=job-199'")) << "every live job is reachable from the page";
}

TEST(StatusPageTest, EveryClientChosenStringIsEscaped) {
  coordinator::PageInput in;
  auto* job = in.snapshot.status.add_jobs();
  job->set_job_id("<script>alert(1)</script>");
  auto* r = in.snapshot.ranks.add_ranks();
  r->set_job_id(job->job_id());
  r->set_host("\"><img src=x onerror=alert(1)>");
  r->set_state(v1::RANK_STATE_DEAD);
  r->set_dead_reason("killed & gone");
  const std::string page = coordinator::StatusPage(in);
  EXPECT_THAT(page, ::testing::Not(HasSubstr("<script>")));
  EXPECT_THAT(page, ::testing::Not(HasSubstr("<img")));
  EXPECT_THAT(page, HasSubstr("&lt;script&gt;alert(1)&lt;/script&gt;"));
  EXPECT_THAT(page, HasSubstr("killed &amp; gone"));
  EXPECT_THAT(page, HasSubstr("class='rank dead'"));
}

}  // namespace
}  // namespace shardcoord
