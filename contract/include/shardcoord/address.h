// A coordinator's address as workers and shardctl dial it: HOST:PORT or [IPV6]:PORT. Checked
// before gRPC sees it (gRPC takes "host:99999" or "http://host:7871" and fails later, or
// quietly dials another port), and, when it cannot be reached, what failed, named.
#ifndef SHARDCOORD_ADDRESS_H_
#define SHARDCOORD_ADDRESS_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace shardcoord {

// Why `address` is not HOST:PORT or [IPV6]:PORT with a port in 1..65535, or "" when it is.
std::string AddressProblem(absl::string_view address);

// What a plain TCP connection to `address` (checked by AddressProblem) finds within `timeout`:
// "" when something accepts it; otherwise what failed, for a message ("the host 'x' does not
// resolve: Name or service not known", "connection refused: nothing listens on 127.0.0.1:7871",
// "no answer within 1000 ms"). The resolver's own timeout bounds the name lookup.
std::string ReachProblem(absl::string_view address, absl::Duration timeout);

// The host part of `address` (without brackets), for a resolver.
std::string AddressHost(absl::string_view address);

}  // namespace shardcoord

#endif  // SHARDCOORD_ADDRESS_H_
