#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>

#include <sqlite3.h>

#include "coordinator/journal.h"
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
  JobRecord r;
  r.summary.id = 3;
  r.summary.name = "old";
  r.summary.state = JobState::kQueued;
  {
    Journal j(path.string());
    j.SaveJob(r);
  }
  {  // Rebuild `jobs` without its last column, as the previous version wrote it.
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
    const char* sql =
        "CREATE TABLE old AS SELECT id, name, state, reason, priority, store_name, fingerprint,"
        " spec_source, spec_toml, spec_blob, output_dir, adapter_path, worker_id, worker_host,"
        " worker_device, attempt, retries, step, total_steps, checkpoint_step, checkpoint_path,"
        " cancel_requested, submitted_at, started_at, finished_at FROM jobs;"
        "DROP TABLE jobs; ALTER TABLE old RENAME TO jobs;";
    REQUIRE(sqlite3_exec(db, sql, nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  Journal j(path.string());
  std::vector<JobRecord> jobs = j.LoadJobs();
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0].summary.name == "old");
  CHECK(jobs[0].owner.empty());
  r.summary.id = 4;
  r.owner = "KEY";
  j.SaveJob(r);
  jobs = j.LoadJobs();
  REQUIRE(jobs.size() == 2);
  CHECK(jobs[1].owner == "KEY");
}
