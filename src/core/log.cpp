#include "epx/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace epx {
namespace {

LogLevel level_from_env() {
  const char* env = std::getenv("EPX_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kWarn;
  const std::string s(env);
  if (s == "trace") return LogLevel::kTrace;
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "error") return LogLevel::kError;
  if (s == "off") return LogLevel::kOff;
  return LogLevel::kWarn;
}

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return spdlog::level::trace;
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
    case LogLevel::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::warn;
}

spdlog::logger& logger() {
  static const std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("epx");
    l->set_pattern("[epx %^%l%$] %v");
    l->set_level(to_spdlog(level_from_env()));
    return l;
  }();
  return *instance;
}

std::atomic<LogLevel> g_level{level_from_env()};

}  // namespace

void set_log_level(LogLevel level) {
  g_level = level;
  logger().set_level(to_spdlog(level));
}

LogLevel log_level() { return g_level; }

void log(LogLevel level, std::string_view message) {
  if (level < g_level.load()) return;
  logger().log(to_spdlog(level), "{}", message);
}

}  // namespace epx
