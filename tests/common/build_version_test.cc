#include "common/base/build_version.h"

#include <algorithm>

#include <catch2/catch.hpp>

TEST_CASE("--version's text: the program, version, commit, LibTorch and CUDA", "[common]") {
  const std::string text = lorastream::VersionText("lorastream-store");
  INFO(text);
  CHECK_THAT(text, Catch::StartsWith("lorastream-store 0.1.0 (commit "));
  CHECK_THAT(text, Catch::Contains("LibTorch") &&
                       (Catch::EndsWith(", CPU only\n") || Catch::Contains(", CUDA ")));
  CHECK(std::count(text.begin(), text.end(), '\n') == 2);
}
