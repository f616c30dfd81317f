// Logging: spdlog behind a small facade so that only log.cc includes spdlog's heavy headers
// where formatting is not needed. Messages go to stderr, optionally also to a file.
#pragma once

#include <string>

// LS_LOG_DEBUG compiles in (spdlog drops calls below SPDLOG_ACTIVE_LEVEL at compile time);
// whether it prints is decided at run time by the logger's level (LORASTREAM_LOG=debug).
#ifndef SPDLOG_ACTIVE_LEVEL
#define SPDLOG_ACTIVE_LEVEL SPDLOG_LEVEL_DEBUG
#endif
#include <spdlog/spdlog.h>
static_assert(SPDLOG_ACTIVE_LEVEL <= SPDLOG_LEVEL_DEBUG,
              "spdlog was included before common/base/log.h: LS_LOG_DEBUG would be compiled out");

namespace lorastream {

// Sets up the process-wide logger: `name` prefixes each line; `file` (optional) gets a copy.
// level: "trace", "debug", "info", "warn", "error", "off". The environment variable
// LORASTREAM_LOG, when set to one of these, overrides `level` (e.g. LORASTREAM_LOG=debug);
// an unknown value there is reported on stderr and ignored.
void InitLogging(const std::string& name, const std::string& level = "info",
                 const std::string& file = "");

}  // namespace lorastream

#define LS_LOG_DEBUG(...) SPDLOG_DEBUG(__VA_ARGS__)
#define LS_LOG_INFO(...) spdlog::info(__VA_ARGS__)
#define LS_LOG_WARN(...) spdlog::warn(__VA_ARGS__)
#define LS_LOG_ERROR(...) spdlog::error(__VA_ARGS__)
