// The listener self-check of CoordinatorServer (see StartSelfCheck in coordinator_server.h):
// gRPC 1.51 stops accepting for good once accept() fails with EMFILE, so the daemon calls
// itself every `self_check_interval` and, once its calls have got no answer for
// kMinDeafFor (and at least three in a row), reports the listener lost (shardcoordd then exits
// 3 for its supervisor to restart it). A deaf listener stays deaf, so waiting costs little; a
// daemon that was only stalled (SIGSTOP, a VM pause, a backlog after one) answers again before
// then. A call that itself took far past its deadline (the process, not the listener, stalled)
// is not counted.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>

#include <algorithm>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/server/coordinator_server.h"
#include "coordinator/server/tls.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace shardcoord::coordinator {

void CoordinatorServer::StartSelfCheck(const CoordinatorOptions& options) {
  bool self_check = options.limits.self_check_interval > absl::ZeroDuration();
  if (self_check && options.tls.mutual() && !ServerCertificateIsAClient(options.tls)) {
    self_check = false;
    logging::Get("coordinator")
        ->warn("listener self-check off: under mutual TLS it presents the daemon's certificate, which the client "
               "CA does not accept as a client certificate; issue it from that CA with extendedKeyUsage "
               "serverAuth,clientAuth to have a deaf listener noticed");
  }
  if (self_check) {
    self_check_ = std::thread([this] { SelfCheckLoop(); });
  }
}

namespace {

// How long the listener must stay deaf before the daemon gives up on it.
constexpr absl::Duration kMinDeafFor = absl::Seconds(10);

// Open descriptors of this process (for the self-check's message).
int OpenDescriptors() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) n++;
    closedir(d);
  }
  return n > 2 ? n - 3 : n;  // ".", ".." and the directory's own descriptor
}

// Whether the self-check's call shows the listener accepting. Any answer does (a refused token
// too); a call that never got one (DEADLINE_EXCEEDED, or UNAVAILABLE: no connection formed)
// does not.
bool ListenerAnswered(const grpc::Status& st) {
  return st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED && st.error_code() != grpc::StatusCode::UNAVAILABLE;
}

}  // namespace

void CoordinatorServer::SelfCheckLoop() {
  const absl::Duration interval = core_->options().limits.self_check_interval;
  const TlsSettings& tls = tls_;  // The checked copy, as the listener serves.
  // Our own address, reached over loopback when we listen on every interface.
  std::string target = address_;
  if (absl::StartsWith(target, "0.0.0.0:")) target = "127.0.0.1:" + target.substr(8);
  if (absl::StartsWith(target, "[::]:")) target = "[::1]:" + target.substr(5);
  int failures = 0;
  bool reported = false;
  absl::Time deaf_since = absl::InfinitePast();
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval);
    if (stopping_) break;
    mu_.Unlock();
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // A new connection: it must be accepted.
    auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(target, SelfCheckCredentials(tls), args));
    grpc::ClientContext ctx;
    const absl::Time started = absl::Now();
    const absl::Duration timeout = std::min(interval, absl::Seconds(2));
    ctx.set_deadline(absl::ToChronoTime(started + timeout));
    v1::StatusRequest req;
    req.set_job_id("\x01self-check");  // Matches no job: a small answer.
    v1::StatusResponse resp;
    const grpc::Status st = stub->GetStatus(&ctx, req, &resp);
    const bool stalled = absl::Now() - started > timeout + absl::Seconds(1);  // This process was paused.
    if (ListenerAnswered(st)) {
      failures = 0;
      reported = false;
    } else if (!stalled) {
      if (failures++ == 0) deaf_since = started;
    }
    if (failures >= 3 && !reported && absl::Now() - deaf_since >= std::max(3 * interval, kMinDeafFor)) {
      reported = true;
      rlimit lim{};
      getrlimit(RLIMIT_NOFILE, &lim);
      const std::string why = absl::StrCat(
          "the server no longer accepts connections on ", address_, " (", failures, " self-checks over ",
          absl::ToInt64Seconds(absl::Now() - deaf_since), " s got no answer, last: ", st.error_message(),
          "); open descriptors ", OpenDescriptors(), " of limit ", lim.rlim_cur,
          ": with descriptors exhausted gRPC stops accepting for good. Raise the open file limit "
          "(LimitNOFILE, ulimit -n) to about one per rank plus 64");
      logging::Get("coordinator")->critical("{}", why);
      if (on_listener_lost_) on_listener_lost_(why);
    }
    mu_.Lock();
  }
}

}  // namespace shardcoord::coordinator
