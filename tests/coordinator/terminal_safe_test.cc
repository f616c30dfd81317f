// User strings reach the terminal escaped: `jobs`, `show` and `watch` print a job name holding
// an escape sequence as text, never as the sequence.
#include <catch2/catch.hpp>

#include "coordinator/cli_format.h"
#include "coordinator/watch_view.h"

using namespace lorastream;
using namespace lorastream::cli;

TEST_CASE("jobs, show and watch escape control characters in user strings", "[coordinator]") {
  JobSummary j;
  j.id = 7;
  j.name = "evil\x1b]0;pwned\x07\x1b[2J";
  j.state = JobState::kFailed;
  j.reason = "bad\rreason";
  j.output_dir = "/tmp/out\x1b[31m";
  const std::string table = JobsTable({j});
  ShowJobReply show;
  show.job = j;
  show.spec_toml = "name = \"x\"\n# \x1b[1mcomment\n";
  const std::string details = JobDetails(show);
  const std::string line = RenderLine(j);
  for (const std::string& text : {table, details, line}) {
    INFO(text);
    CHECK(text.find('\x1b') == std::string::npos);
    CHECK(text.find('\x07') == std::string::npos);
    CHECK(text.find('\r') == std::string::npos);
    CHECK_THAT(text, Catch::Contains("evil\\x1b]0;pwned\\x07\\x1b[2J"));
  }
  CHECK_THAT(details, Catch::Contains("/tmp/out\\x1b[31m"));
  CHECK_THAT(details, Catch::Contains("name = \"x\"\n# \\x1b[1mcomment\n"));  // lines kept
}
