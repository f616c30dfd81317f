#include "worker/stream/stream_stats.h"

#include <cstdio>

#include "common/base/format_bytes.h"
#include "worker/stream/stream_budget.h"

namespace lorastream::worker {

std::string FormatStreamStats(const StepStats& s) {
  char buf[256];
  const double gbps = s.h2d_busy_seconds > 0 ? s.h2d_bytes / s.h2d_busy_seconds / 1e9 : 0.0;
  std::snprintf(buf, sizeof buf,
                "h2d %.2f GB (%.1f ms busy, %.1f GB/s) stall %.1f ms copies %lld saved %lld",
                s.h2d_bytes / 1e9, s.h2d_busy_seconds * 1e3, gbps, s.stall_seconds * 1e3,
                static_cast<long long>(s.copies), static_cast<long long>(s.copies_saved));
  std::string out = buf;
  if (s.peak_device_bytes > 0) out += " peak " + FormatBytes(s.peak_device_bytes, 2);
  return out;
}

}  // namespace lorastream::worker
