#include "common/base/terminal_text.h"

#include <catch2/catch.hpp>

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
