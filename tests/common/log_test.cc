#include "common/base/log.h"

#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include "tests/support/test_support.h"

namespace {

// Logs one debug and one info line into `file` under the given LORASTREAM_LOG (null: unset)
// and returns what reached the file.
std::string LogTwoLines(const std::string& file, const char* env, const std::string& level) {
  if (env) {
    setenv("LORASTREAM_LOG", env, 1);
  } else {
    unsetenv("LORASTREAM_LOG");
  }
  lorastream::InitLogging("log-test", level, file);
  LS_LOG_DEBUG("a debug line {}", 1);
  LS_LOG_INFO("an info line {}", 2);
  unsetenv("LORASTREAM_LOG");
  lorastream::InitLogging("log-test");  // a logger without the file: closes it
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TEST_CASE("LS_LOG_DEBUG is compiled in and LORASTREAM_LOG turns it on at run time", "[common]") {
  const lorastream::testing::TempDir temp("log");
  const std::string& dir = temp.str();

  const std::string quiet = LogTwoLines(dir + "/quiet.log", nullptr, "info");
  CHECK_THAT(quiet, Catch::Contains("an info line 2"));
  CHECK_THAT(quiet, !Catch::Contains("a debug line"));

  const std::string loud = LogTwoLines(dir + "/loud.log", "debug", "info");
  CHECK_THAT(loud, Catch::Contains("a debug line 1"));
  CHECK_THAT(loud, Catch::Contains("an info line 2"));

  // The variable wins over the executable's own level, both ways.
  const std::string silenced = LogTwoLines(dir + "/warn.log", "warn", "debug");
  CHECK_THAT(silenced, !Catch::Contains("a debug line"));
  CHECK_THAT(silenced, !Catch::Contains("an info line"));

  // A misspelt level is ignored (spdlog alone would turn it into "off").
  const std::string typo = LogTwoLines(dir + "/typo.log", "debgu", "info");
  CHECK_THAT(typo, Catch::Contains("an info line 2"));
}
