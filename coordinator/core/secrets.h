// Session keys (DESIGN 12 and 13): a random secret per registered session that the rank's
// communicator calls must carry, compared in constant time.
#ifndef SHARDCOORD_COORDINATOR_CORE_SECRETS_H_
#define SHARDCOORD_COORDINATOR_CORE_SECRETS_H_

#include <cstdint>
#include <random>
#include <string>

namespace shardcoord::coordinator {

// 128 bits from the system's random source, as 32 hex digits.
inline std::string NewSessionKey() {
  static thread_local std::random_device source;  // getrandom(2) / /dev/urandom in libstdc++.
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 4; ++i) {
    uint32_t v = source();
    for (int j = 0; j < 8; ++j, v >>= 4) out += kHex[v & 15];
  }
  return out;
}

// Equal without a timing signal about where they differ. An empty expected secret matches nothing.
inline bool SameSecret(const std::string& given, const std::string& expected) {
  if (expected.empty() || given.size() != expected.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < expected.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ expected[i]);
  return diff == 0;
}

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_SECRETS_H_
