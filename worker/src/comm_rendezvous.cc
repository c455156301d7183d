// The client side of a communicator epoch at the coordinator: its key-value store (the
// rendezvous data of Gloo and NCCL) and health reports. Shared by every backend.
#include <grpcpp/grpcpp.h>

#include "communicator_internal.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord {

size_t DataTypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kUint8: return 1;
  }
  return 1;
}

namespace internal {
namespace {

// Extra time a unary RPC gets beyond the wait it asks the coordinator for.
constexpr absl::Duration kRpcSlack = absl::Seconds(5);

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
}

}  // namespace

absl::Status StorePublish(const CommEndpoint& ep, const std::string& name, int64_t epoch, const std::string& key,
                          const std::string& value) {
  v1::StoreSetRequest req;
  req.set_job_id(ep.job_id);
  req.set_rank(ep.job_rank);
  req.set_name(name);
  req.set_epoch(epoch);
  req.set_key(key);
  req.set_value(value);
  v1::StoreSetResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, kRpcSlack);
  return FromGrpcStatus(ep.stub->StoreSet(&ctx, req, &resp));
}

absl::StatusOr<std::vector<std::string>> StoreFetch(const CommEndpoint& ep, const std::string& name, int64_t epoch,
                                                    const std::vector<std::string>& keys, absl::Duration timeout) {
  v1::StoreGetRequest req;
  req.set_job_id(ep.job_id);
  req.set_rank(ep.job_rank);
  req.set_name(name);
  req.set_epoch(epoch);
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(timeout)));
  v1::StoreGetResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout + kRpcSlack);
  grpc::Status s = ep.stub->StoreGet(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return std::vector<std::string>(resp.values().begin(), resp.values().end());
}

absl::Status ReportComm(const CommEndpoint& ep, const std::string& name, int64_t epoch,
                        v1::CommReportRequest::Kind kind, const std::string& error) {
  v1::CommReportRequest req;
  req.set_job_id(ep.job_id);
  req.set_rank(ep.job_rank);
  req.set_name(name);
  req.set_epoch(epoch);
  req.set_kind(kind);
  req.set_error(error);
  v1::CommReportResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, kRpcSlack);
  return FromGrpcStatus(ep.stub->CommReport(&ctx, req, &resp));
}

}  // namespace internal
}  // namespace shardcoord
