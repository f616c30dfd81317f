// `lorastream submit` refuses sizes that would exhaust memory, before the job is queued; the
// command's exit statuses are the README's.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::testing;
namespace fs = std::filesystem;

TEST_CASE("submit refuses train.batch_size = 1e8 and grad_accum = 4.6e18, naming the limit",
          "[coordinator][cluster]") {
  Cluster c("limits");
  c.StartCoordinator();
  for (const std::string line : {"batch_size = 100000000", "grad_accum = 4600000000000000000"}) {
    // WriteJob's file ends inside [train]: the key lands there.
    const std::string job = c.WriteJob("big", 5);
    std::ofstream(job, std::ios::app) << line << "\n";
    int code = -1;
    c.Cli({"submit", job}, &code);
    CHECK(code == 5);
    std::ifstream err(c.dir() / "cli.stderr");
    const std::string errors((std::istreambuf_iterator<char>(err)),
                             std::istreambuf_iterator<char>());
    INFO(errors);
    CHECK_THAT(errors, Catch::Contains("above the limit of"));
    CHECK_THAT(errors, Catch::Contains(line.substr(0, line.find(' '))));
  }
  int code = -1;
  const std::string jobs = c.Cli({"jobs", "--json"}, &code);
  CHECK(code == 0);
  CHECK_THAT(jobs, !Catch::Contains("\"big\""));  // nothing was queued
}

TEST_CASE("lorastream exits 2 for a bad command line, 3 for a missing job file",
          "[coordinator][cluster]") {
  Cluster c("exitcodes");
  int code = -1;
  c.Cli({"--no-such-option"}, &code);
  CHECK(code == 2);  // CLI11 alone would exit 109
  c.Cli({"submit"}, &code);
  CHECK(code == 2);  // the job file is required (CLI11: 106)
  c.Cli({"submit", (c.dir() / "missing.toml").string()}, &code);
  CHECK(code == 3);
  c.Cli({"--help"}, &code);
  CHECK(code == 0);
  // A job id above 2^63 is named as typed, never as another number (2^63-1, or -1).
  c.Cli({"show", "18446744073709551615"}, &code);
  CHECK(code == 2);
  std::ifstream err(c.dir() / "cli.stderr");
  const std::string errors((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  CHECK_THAT(errors, Catch::Contains("18446744073709551615"));
  // (" -1" and "(found -1": the stderr also holds paths of a random temporary folder.)
  CHECK_THAT(errors, !Catch::Contains(" -1") && !Catch::Contains("found -1") &&
                         !Catch::Contains("9223372036854775807)"));
}
