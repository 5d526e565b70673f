// Logging. Level from EPX_LOG_LEVEL (trace, debug, info, warn, error, off; default warn).
#pragma once

#include <string_view>

namespace epx {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kOff };

void set_log_level(LogLevel level);
LogLevel log_level();
void log(LogLevel level, std::string_view message);

}  // namespace epx
