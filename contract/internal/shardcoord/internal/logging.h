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

#include <memory>
#include <string>

namespace shardcoord::logging {

inline constexpr char kLevelEnv[] = "SHARDCOORD_LOG_LEVEL";
inline constexpr char kFormatEnv[] = "SHARDCOORD_LOG_FORMAT";

// Returns the logger "shardcoord.<component>", creating it on first use (stderr).
std::shared_ptr<spdlog::logger> Get(const std::string& component);

// Overrides the level of every shardcoord logger created so far and later
// ("info", "debug", ...). Returns false for an unknown level name.
bool SetLevel(const std::string& level);

}  // namespace shardcoord::logging

#endif  // SHARDCOORD_INTERNAL_LOGGING_H_
