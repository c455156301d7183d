// The one small wrapper over spdlog used by every shardcoord component.
//
// Loggers are named ("shardcoord.coordinator", "shardcoord.worker", ...) and are never
// made the process default: the worker library is loaded into trainers that may use
// spdlog themselves. Level and format come from the environment, read once:
//   SHARDCOORD_LOG_LEVEL  trace|debug|info|warn|error|off   (default info)
//   SHARDCOORD_LOG_FORMAT text|json                          (default text)
// Lines are key=value structured: every worker line carries job, rank and, where known,
// step and microbatch. Thread-safe.
#ifndef SHARDCOORD_INTERNAL_LOGGING_H_
#define SHARDCOORD_INTERNAL_LOGGING_H_

#include <spdlog/spdlog.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace shardcoord::logging {

inline constexpr char kLevelEnv[] = "SHARDCOORD_LOG_LEVEL";
inline constexpr char kFormatEnv[] = "SHARDCOORD_LOG_FORMAT";

// Returns the logger "shardcoord.<component>", creating it on first use (stderr).
std::shared_ptr<spdlog::logger> Get(const std::string& component);

// Overrides the level of every shardcoord logger created so far and later
// ("info", "debug", ...). Returns false for an unknown level name.
bool SetLevel(const std::string& level);

// Lets through at most `per_second` events in each second and counts the rest, so that one
// client flooding bad input cannot flood the log. Thread-safe.
class RateLimit {
 public:
  explicit RateLimit(int per_second) : per_second_(per_second) {}
  // True if this event may be logged; then *suppressed is how many were held back since
  // the last one let through (to say so in the line).
  bool Allow(int64_t* suppressed);

 private:
  const int per_second_;
  std::mutex mu_;
  int64_t window_ = -1;  // Seconds since the epoch of the current window.
  int in_window_ = 0;
  int64_t suppressed_ = 0;
};

}  // namespace shardcoord::logging

#endif  // SHARDCOORD_INTERNAL_LOGGING_H_
