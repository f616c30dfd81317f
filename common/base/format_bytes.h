// The one byte formatter of every component (listings, logs, error messages).
#pragma once

#include <cstdint>
#include <string>

namespace lorastream {

// "141.0 GiB", "12.50 MiB", "512 B": the largest binary unit (B, KiB, MiB, GiB, TiB) in which
// the value is at least 1, with `decimals` digits after the point (none for plain bytes).
std::string FormatBytes(uint64_t bytes, int decimals = 1);

// "29.92 GiB": always in GiB, for messages that compare sizes (needed against free).
std::string FormatGiB(uint64_t bytes, int decimals = 2);

}  // namespace lorastream
