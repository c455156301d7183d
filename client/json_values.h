// How the client's JSON readers (traces and manifests, cost files, verify's per-rank lines)
// judge and show a value. Private to client/: included by its .cc files only.
#ifndef SHARDCOORD_CLIENT_JSON_VALUES_H_
#define SHARDCOORD_CLIENT_JSON_VALUES_H_

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace shardcoord::client {

// Whether `v` is an integer in [min, max]. A number the JSON library holds as a double (one
// with a fraction or past the 64-bit range) is not; an unsigned one past INT64_MAX is
// compared, not wrapped. Reading it with get<int64_t>() is then exact.
inline bool JsonIntegerIn(const nlohmann::json& v, int64_t min, int64_t max) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned()) {  // Every non-negative integer the library parsed.
    const uint64_t u = v.get<uint64_t>();
    return max >= 0 && u <= static_cast<uint64_t>(max) && (min <= 0 || u >= static_cast<uint64_t>(min));
  }
  const int64_t n = v.get<int64_t>();
  return n >= min && n <= max;
}

// A value as an error message shows it: its JSON, cut short.
inline std::string JsonShown(const nlohmann::json& v) {
  std::string text = v.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_JSON_VALUES_H_
