// gRPC channel credentials from TlsFiles (worker.h): for the in-tree programs that open their
// own channels to the coordinator (shardctl, benchmarks, tests). Trainers use Worker, which
// calls this itself.
#ifndef SHARDCOORD_CHANNEL_CREDENTIALS_H_
#define SHARDCOORD_CHANNEL_CREDENTIALS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <memory>

#include "absl/status/statusor.h"
#include "shardcoord/export.h"
#include "shardcoord/worker.h"

namespace shardcoord {

// TLS credentials reading the files now (plaintext when `tls` has no CA file); sets the
// target name override in `args` when `tls.server_name` is given. INVALID_ARGUMENT names a
// file that cannot be read or a certificate given without its key.
SHARDCOORD_EXPORT absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const TlsFiles& tls, grpc::ChannelArguments& args);

}  // namespace shardcoord

#endif  // SHARDCOORD_CHANNEL_CREDENTIALS_H_
