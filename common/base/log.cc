#include "common/base/log.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include "common/base/terminal_text.h"

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

namespace {

// Escapes control characters in every message (job names, paths and errors carry user text)
// before the real sinks format it; the sinks' own colours are added after, by the sinks.
class TerminalSafeSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit TerminalSafeSink(std::vector<spdlog::sink_ptr> sinks) : sinks_(std::move(sinks)) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const std::string safe = TerminalSafe(std::string_view(msg.payload.data(), msg.payload.size()));
    spdlog::details::log_msg copy = msg;
    copy.payload = spdlog::string_view_t(safe.data(), safe.size());
    for (auto& sink : sinks_)
      if (sink->should_log(copy.level)) sink->log(copy);
  }
  void flush_() override {
    for (auto& sink : sinks_) sink->flush();
  }
  void set_pattern_(const std::string& pattern) override {
    for (auto& sink : sinks_) sink->set_pattern(pattern);
  }
  void set_formatter_(std::unique_ptr<spdlog::formatter> formatter) override {
    for (auto& sink : sinks_) sink->set_formatter(formatter->clone());
  }

 private:
  std::vector<spdlog::sink_ptr> sinks_;
};

}  // namespace

void InitLogging(const std::string& name, const std::string& level, const std::string& file) {
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!file.empty()) sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(file));
  auto safe = std::make_shared<TerminalSafeSink>(std::move(sinks));
  auto logger = std::make_shared<spdlog::logger>(name, safe);
  logger->set_pattern("%Y-%m-%d %H:%M:%S.%e [%n %P] %^%l%$ %v");
  logger->set_level(LevelFromEnvironment(spdlog::level::from_str(level)));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

}  // namespace lorastream
