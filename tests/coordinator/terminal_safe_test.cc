// User strings reach the terminal escaped: `jobs`, `show` and `watch` print a job name holding
// an escape sequence as text, never as the sequence.
#include <catch2/catch.hpp>

#include <sstream>

#include "coordinator/cli/cli_format.h"
#include "coordinator/cli/watch_view.h"

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
  }
  CHECK_THAT(table, Catch::Contains("evil\\x1b]0;pwned"));  // the NAME column is cut to its width
  for (const std::string& text : {details, line})
    CHECK_THAT(text, Catch::Contains("evil\\x1b]0;pwned\\x07\\x1b[2J"));
  CHECK_THAT(details, Catch::Contains("/tmp/out\\x1b[31m"));
  CHECK_THAT(details, Catch::Contains("name = \"x\"\n# \\x1b[1mcomment\n"));  // lines kept
}

TEST_CASE("jobs cuts long names to their column and escapes bidi controls", "[coordinator]") {
  JobSummary a;
  a.id = 1;
  a.name = "a-name-of-twenty-characters-or-more";
  a.state = JobState::kQueued;
  JobSummary b;
  b.id = 2;
  b.name = "invoice\xe2\x80\xaegpj.exe";  // U+202E: would show as "invoiceexe.jpg"
  b.state = JobState::kRunning;
  b.worker_id = "w";
  b.worker_host = "a-host-name-that-is-far-too-long";
  b.worker_device = "cuda:0";
  const std::string table = JobsTable({a, b});
  INFO(table);
  CHECK(table.find("\xe2\x80\xae") == std::string::npos);
  CHECK_THAT(table, Catch::Contains("2     invoice\\u202egpj.e\xe2\x80\xa6 running"));
  // Every column starts where its header does (characters, not bytes: the ellipsis is one).
  std::istringstream lines(table);
  std::string header, first, second;
  std::getline(lines, header);
  std::getline(lines, first);
  std::getline(lines, second);
  const auto column = [](const std::string& line, const std::string& text) {
    const size_t at = line.find(text);
    REQUIRE(at != std::string::npos);
    size_t chars = 0;
    for (size_t i = 0; i < at; ++i) chars += (static_cast<unsigned char>(line[i]) & 0xC0) != 0x80;
    return chars;
  };
  CHECK(column(first, "queued") == column(header, "STATE"));
  CHECK(column(second, "running") == column(header, "STATE"));
  CHECK(column(second, "step 0") == column(header, "PROGRESS"));
  CHECK_THAT(first, Catch::StartsWith("1     a-name-of-twenty-c\xe2\x80\xa6 queued"));
}
