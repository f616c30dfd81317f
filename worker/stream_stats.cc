#include "worker/stream_stats.h"

#include <cstdio>

#include <nlohmann/json.hpp>

#include "worker/stream_budget.h"

namespace lorastream {

std::string StepStatsJson(const StepStats& s) {
  nlohmann::json j = {
      {"step", s.step},
      {"total_steps", s.total_steps},
      {"loss", s.loss},
      {"learning_rate", s.learning_rate},
      {"grad_norm", s.grad_norm},
      {"tokens", s.tokens},
      {"step_seconds", s.step_seconds},
      {"tokens_per_second", s.tokens_per_second},
      {"h2d_bytes", s.h2d_bytes},
      {"h2d_busy_seconds", s.h2d_busy_seconds},
      {"stall_seconds", s.stall_seconds},
      {"copies", s.copies},
      {"copies_saved", s.copies_saved},
      {"peak_device_bytes", s.peak_device_bytes},
  };
  return j.dump();
}

std::string FormatStreamStats(const StepStats& s) {
  char buf[256];
  const double gbps = s.h2d_busy_seconds > 0 ? s.h2d_bytes / s.h2d_busy_seconds / 1e9 : 0.0;
  std::snprintf(buf, sizeof buf,
                "h2d %.2f GB (%.1f ms busy, %.1f GB/s) stall %.1f ms copies %lld saved %lld",
                s.h2d_bytes / 1e9, s.h2d_busy_seconds * 1e3, gbps, s.stall_seconds * 1e3,
                static_cast<long long>(s.copies), static_cast<long long>(s.copies_saved));
  std::string out = buf;
  if (s.peak_device_bytes > 0) out += " peak " + FormatBytes(s.peak_device_bytes);
  return out;
}

}  // namespace lorastream
