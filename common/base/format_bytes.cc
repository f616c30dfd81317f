#include "common/base/format_bytes.h"

#include <cstdio>

namespace lorastream {

std::string FormatBytes(uint64_t bytes, int decimals) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f %s", unit == 0 ? 0 : decimals, value, kUnits[unit]);
  return buf;
}

std::string FormatGiB(uint64_t bytes, int decimals) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f GiB", decimals, static_cast<double>(bytes) / (1ull << 30));
  return buf;
}

}  // namespace lorastream
