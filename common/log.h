// Logging: spdlog behind a small facade so that only log.cc includes spdlog's heavy headers
// where formatting is not needed. Messages go to stderr, optionally also to a file.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace lorastream {

// Sets up the process-wide logger: `name` prefixes each line; `file` (optional) gets a copy.
// level: "trace", "debug", "info", "warn", "error".
void InitLogging(const std::string& name, const std::string& level = "info",
                 const std::string& file = "");

}  // namespace lorastream

#define LS_LOG_DEBUG(...) SPDLOG_DEBUG(__VA_ARGS__)
#define LS_LOG_INFO(...) spdlog::info(__VA_ARGS__)
#define LS_LOG_WARN(...) spdlog::warn(__VA_ARGS__)
#define LS_LOG_ERROR(...) spdlog::error(__VA_ARGS__)
