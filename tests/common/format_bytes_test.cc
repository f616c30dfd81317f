#include "common/base/format_bytes.h"

#include <catch2/catch.hpp>

using lorastream::FormatBytes;
using lorastream::FormatGiB;

TEST_CASE("FormatBytes picks the largest binary unit; FormatGiB stays in GiB", "[common]") {
  CHECK(FormatBytes(0) == "0 B");
  CHECK(FormatBytes(1023) == "1023 B");
  CHECK(FormatBytes(1024) == "1.0 KiB");
  CHECK(FormatBytes(1536, 2) == "1.50 KiB");
  CHECK(FormatBytes(12ull << 20) == "12.0 MiB");
  CHECK(FormatBytes(141ull << 30) == "141.0 GiB");
  CHECK(FormatBytes(16ull << 30, 2) == "16.00 GiB");
  CHECK(FormatBytes(3ull << 40) == "3.0 TiB");
  CHECK(FormatBytes(5000ull << 40) == "5000.0 TiB");  // no unit past TiB
  CHECK(FormatBytes(UINT64_MAX, 0) == "16777216 TiB");
  CHECK(FormatGiB(0) == "0.00 GiB");
  CHECK(FormatGiB(1ull << 29, 3) == "0.500 GiB");
  CHECK(FormatGiB(32126255104ull) == "29.92 GiB");
}
