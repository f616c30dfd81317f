#include "common/terminal_text.h"

#include <catch2/catch.hpp>

#include "common/byte_format.h"

using namespace lorastream;

TEST_CASE("TerminalSafe escapes C0, DEL, C1 and invalid UTF-8, keeps valid text", "[common]") {
  CHECK(TerminalSafe("plain job-1 (r=16)") == "plain job-1 (r=16)");
  CHECK(TerminalSafe("a\x1b[31mb") == "a\\x1b[31mb");
  CHECK(TerminalSafe("tab\there\nline") == "tab\\x09here\\x0aline");
  CHECK(TerminalSafe("tab\there\nline", true) == "tab\\x09here\nline");
  CHECK(TerminalSafe("del\x7f") == "del\\x7f");
  CHECK(TerminalSafe("csi\xc2\x9b"
                     "2J") == "csi\\u009b2J");  // C1 CSI as UTF-8
  CHECK(TerminalSafe("raw\x9b"
                     "2J") == "raw\\x9b2J");  // C1 CSI as a raw byte
  CHECK(TerminalSafe("caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80") ==
        "caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80");     // é 日 😀 unchanged
  CHECK(TerminalSafe("cut\xe6\x97") == "cut\\xe6\\x97");  // truncated sequence
  CHECK(TerminalSafe(std::string("nul\0x", 5)) == "nul\\x00x");
}

TEST_CASE("one byte formatter: units by size, never 0.00 GiB for a small count", "[common]") {
  CHECK(FormatBytes(0) == "0 B");
  CHECK(FormatBytes(512) == "512 B");
  CHECK(FormatBytes(1536) == "1.50 KiB");
  CHECK(FormatBytes(300ull << 20) == "300.00 MiB");
  CHECK(FormatBytes(8ull << 30) == "8.00 GiB");
  CHECK(FormatBytes(3ull << 40) == "3.00 TiB");
  CHECK(FormatBytes(4096) != "0.00 GiB");
  CHECK(FormatBytes(UINT64_MAX) == "16.00 EiB");
}
