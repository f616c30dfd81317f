#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

namespace lorastream {
namespace {

// The level LORASTREAM_LOG asks for, or `fallback` when it is unset or names no level
// (spdlog's from_str turns an unknown name into "off", which would silence a typo's author).
spdlog::level::level_enum LevelFromEnvironment(spdlog::level::level_enum fallback) {
  const char* env = std::getenv("LORASTREAM_LOG");
  if (env == nullptr || *env == '\0') return fallback;
  const std::string wanted = env;
  for (int l = spdlog::level::trace; l < spdlog::level::n_levels; ++l) {
    const auto level = static_cast<spdlog::level::level_enum>(l);
    const auto& level_name = spdlog::level::to_string_view(level);
    if (wanted == std::string(level_name.data(), level_name.size())) return level;
  }
  if (wanted == "warn") return spdlog::level::warn;
  std::fprintf(stderr,
               "lorastream: LORASTREAM_LOG=%s is not one of trace, debug, info, warn, error, "
               "critical, off: ignored\n",
               env);
  return fallback;
}

}  // namespace

void InitLogging(const std::string& name, const std::string& level, const std::string& file) {
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!file.empty()) sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(file));
  auto logger = std::make_shared<spdlog::logger>(name, sinks.begin(), sinks.end());
  logger->set_pattern("%Y-%m-%d %H:%M:%S.%e [%n %P] %^%l%$ %v");
  logger->set_level(LevelFromEnvironment(spdlog::level::from_str(level)));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

}  // namespace lorastream
