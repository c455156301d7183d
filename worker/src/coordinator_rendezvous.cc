// EpochRendezvous at the coordinator: the per-(communicator, epoch) key-value store (the
// rendezvous data of Gloo and NCCL) and health reports, over gRPC (DESIGN 4).
#include "coordinator_rendezvous.h"

#include <grpcpp/grpcpp.h>

#include "shardcoord/proto/convert.h"

namespace shardcoord::internal {
namespace {

// Extra time a unary RPC gets beyond the wait it asks the coordinator for.
constexpr absl::Duration kRpcSlack = absl::Seconds(5);

class CoordinatorRendezvous final : public EpochRendezvous {
 public:
  CoordinatorRendezvous(const CommEndpoint& ep, std::string name, int64_t epoch)
      : ep_(ep), name_(std::move(name)), epoch_(epoch) {}

  absl::Status Publish(const std::string& key, const std::string& value) override {
    v1::StoreSetRequest req;
    Address(&req);
    req.set_key(key);
    req.set_value(value);
    v1::StoreSetResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, kRpcSlack);
    return FromGrpcStatus(ep_.stub->StoreSet(&ctx, req, &resp));
  }

  absl::StatusOr<std::vector<std::string>> Fetch(const std::vector<std::string>& keys,
                                                absl::Duration timeout) override {
    v1::StoreGetRequest req;
    Address(&req);
    for (const auto& k : keys) req.add_keys(k);
    req.set_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(timeout)));
    v1::StoreGetResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, timeout + kRpcSlack);
    grpc::Status s = ep_.stub->StoreGet(&ctx, req, &resp);
    if (!s.ok()) return FromGrpcStatus(s);
    return std::vector<std::string>(resp.values().begin(), resp.values().end());
  }

  absl::Status ReportReady() override { return Report(v1::CommReportRequest::KIND_READY, ""); }
  absl::Status ReportError(const std::string& error) override {
    return Report(v1::CommReportRequest::KIND_ERROR, error);
  }

 private:
  template <typename Req>
  void Address(Req* req) const {
    req->set_job_id(ep_.job_id);
    req->set_rank(ep_.job_rank);
    req->set_name(name_);
    req->set_epoch(epoch_);
    req->set_session_key(ep_.session_key->Get());
  }

  void Prepare(grpc::ClientContext* ctx, absl::Duration d) const {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
    if (!ep_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + ep_.token);
  }

  absl::Status Report(v1::CommReportRequest::Kind kind, const std::string& error) {
    v1::CommReportRequest req;
    Address(&req);
    req.set_kind(kind);
    req.set_error(error);
    v1::CommReportResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, kRpcSlack);
    return FromGrpcStatus(ep_.stub->CommReport(&ctx, req, &resp));
  }

  const CommEndpoint ep_;
  const std::string name_;
  const int64_t epoch_;
};

}  // namespace

std::shared_ptr<EpochRendezvous> MakeCoordinatorRendezvous(const CommEndpoint& endpoint, const std::string& name,
                                                           int64_t epoch) {
  return std::make_shared<CoordinatorRendezvous>(endpoint, name, epoch);
}

}  // namespace shardcoord::internal
