// The one formatter of byte counts shown to people (logs, errors, tables, progress lines).
#pragma once

#include <cstdint>
#include <string>

namespace lorastream {

// Binary units chosen by size, two decimals above bytes: "512 B", "1.50 KiB", "300.00 MiB",
// "8.00 GiB", "1.20 TiB". Never "0.00 GiB" for a non-zero count.
std::string FormatBytes(uint64_t bytes);

}  // namespace lorastream
