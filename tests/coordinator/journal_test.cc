#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>

#include <sqlite3.h>

#include "coordinator/daemon/journal.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using namespace lorastream::coordinator;

TEST_CASE("journal round-trips jobs and statistics across reopen", "[coordinator]") {
  const testing::TempDir dir("journal");
  const std::filesystem::path path = dir.path() / "j.db";
  {
    Journal j(path.string());
    JobRecord r;
    r.summary.id = 5;
    r.summary.name = "x";
    r.summary.state = JobState::kRunning;
    r.summary.checkpoint_step = 40;
    r.spec.lora.rank = 8;
    r.spec_toml = "name = \"x\"";
    r.retries = 2;
    j.SaveJob(r);
    r.summary.step = 41;
    j.SaveJob(r);  // replaces
    StepStats s;
    s.step = 41;
    s.loss = 1.25;
    s.h2d_bytes = 1ull << 35;
    j.AppendStats(5, 1, s);
  }
  Journal j(path.string());
  std::vector<JobRecord> jobs = j.LoadJobs();
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0].summary.step == 41);
  CHECK(jobs[0].summary.state == JobState::kRunning);
  CHECK(jobs[0].spec.lora.rank == 8);
  CHECK(jobs[0].retries == 2);
  std::vector<StepStats> stats = j.LoadStats(5);
  REQUIRE(stats.size() == 1);
  CHECK(stats[0].loss == 1.25);
  CHECK(stats[0].h2d_bytes == (1ull << 35));
  CHECK_THROWS_AS(Journal("/nonexistent-dir/x/j.db"), Error);
}

TEST_CASE("a journal from before job owners opens, keeps its jobs and gains the column",
          "[coordinator]") {
  const testing::TempDir dir("journal-old");
  const std::filesystem::path path = dir.path() / "j.db";
  // The version-0 journal of tests/fixtures, less the columns added since jobs had owners.
  std::filesystem::copy_file(
      std::filesystem::path(LORASTREAM_SOURCE_DIR) / "tests/fixtures/journal-19d7a07/journal.db",
      path);
  {
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
    const char* sql =
        "ALTER TABLE jobs DROP COLUMN owner; ALTER TABLE jobs DROP COLUMN submitter_uid;"
        "ALTER TABLE jobs DROP COLUMN submitter;";
    REQUIRE(sqlite3_exec(db, sql, nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  Journal j(path.string());
  std::vector<JobRecord> jobs = j.LoadJobs();
  REQUIRE(jobs.size() == 5);
  CHECK(jobs[1].summary.name == "code-completion");
  CHECK(jobs[1].owner.empty());
  CHECK(jobs[1].summary.submitter_uid == -1);
  JobRecord r = jobs[0];
  r.summary.id = 6;
  r.owner = "KEY";
  j.SaveJob(r);
  jobs = j.LoadJobs();
  REQUIRE(jobs.size() == 6);
  CHECK(jobs[5].owner == "KEY");
}
