#include "shardcoord/internal/logging.h"

#include <chrono>

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace shardcoord::logging {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<spdlog::logger>> loggers;
  spdlog::level::level_enum level = spdlog::level::info;
  bool json = false;
};

Registry& GetRegistry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    if (const char* lvl = std::getenv(kLevelEnv)) {
      auto parsed = spdlog::level::from_str(lvl);
      // from_str maps unknown names to "off"; only accept "off" when asked for.
      if (parsed != spdlog::level::off || std::string(lvl) == "off") reg->level = parsed;
    }
    if (const char* fmt = std::getenv(kFormatEnv)) reg->json = std::string(fmt) == "json";
    return reg;
  }();
  return *r;
}

}  // namespace

std::shared_ptr<spdlog::logger> Get(const std::string& component) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const std::string name = "shardcoord." + component;
  for (const auto& l : reg.loggers) {
    if (l->name() == name) return l;
  }
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>(name, sink);
  logger->set_level(reg.level);
  if (reg.json) {
    // The message itself is key=value text; it is kept as one JSON string field.
    logger->set_pattern(
        R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","logger":"%n","pid":%P,"msg":"%v"})",
        spdlog::pattern_time_type::utc);
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ %n %v");
  }
  reg.loggers.push_back(logger);
  return logger;
}

bool SetLevel(const std::string& level) {
  auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") return false;
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.level = parsed;
  for (const auto& l : reg.loggers) l->set_level(parsed);
  return true;
}

bool RateLimit::Allow(int64_t* suppressed) {
  const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count();
  std::lock_guard<std::mutex> lock(mu_);
  if (now != window_) {
    window_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= per_second_) {
    suppressed_++;
    return false;
  }
  in_window_++;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

}  // namespace shardcoord::logging
