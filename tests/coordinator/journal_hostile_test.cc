// Issue 42: a journal that is damaged or hostile is refused with a message that says what is
// wrong (and left as it is), and a job row that cannot be read is skipped with an error naming
// the job, never a crash at start and never dispatched.
#include <catch2/catch.hpp>

#include <sqlite3.h>

#include <filesystem>

#include "common/base/error.h"
#include "coordinator/daemon/coordinator.h"
#include "coordinator/daemon/journal.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using namespace lorastream::coordinator;
namespace fs = std::filesystem;

namespace {

void Sql(const fs::path& db_path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(db_path.c_str(), &db) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
  INFO(sql << ": " << (err ? err : ""));
  sqlite3_free(err);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

int64_t SqlInt(const fs::path& db_path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(db_path.c_str(), &db) == SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  REQUIRE(sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr) == SQLITE_OK);
  const int64_t v = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int64(st, 0) : -1;
  sqlite3_finalize(st);
  sqlite3_close(db);
  return v;
}

std::string OpenError(const fs::path& path) {
  try {
    Journal journal(path.string());
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kCorrupt);
    return e.what();
  }
  return "";
}

JobRecord Record(int64_t id, const std::string& name) {
  JobRecord job;
  job.summary.id = id;
  job.summary.name = name;
  job.summary.state = JobState::kQueued;
  job.summary.store_name = "tiny";
  job.spec.name = name;
  job.spec.model.store = "tiny";
  job.spec.train.steps = 10;
  job.spec.train.output_dir = "/tmp/out-" + name;
  job.spec.source = name + ".toml";
  return job;
}

std::vector<std::string> NoProblems(const JobSpec&) { return {}; }

}  // namespace

TEST_CASE("a journal of a negative version or without a jobs table is refused saying so",
          "[coordinator][journal][hostile]") {
  const testing::TempDir dir("journal-hostile");
  const fs::path negative = dir.path() / "negative.db";
  { Journal journal(negative.string()); }
  Sql(negative, "PRAGMA user_version = -5");
  std::string e = OpenError(negative);
  CHECK_THAT(e, Catch::Contains("has version -5, which no lorastream writes"));
  CHECK_THAT(e, !Catch::Contains("duplicate column"));
  CHECK(SqlInt(negative, "PRAGMA user_version") == -5);  // left as it is

  const fs::path no_jobs = dir.path() / "no-jobs.db";
  { Journal journal(no_jobs.string()); }
  Sql(no_jobs, "DROP TABLE jobs");
  e = OpenError(no_jobs);
  CHECK_THAT(e, Catch::Contains("has no jobs table but holds other tables"));
  CHECK(SqlInt(no_jobs, "SELECT count(*) FROM sqlite_master WHERE name = 'jobs'") == 0);
  Sql(no_jobs, "PRAGMA user_version = 0");
  CHECK_THAT(OpenError(no_jobs), Catch::Contains("has no jobs table"));

  // Version 0 with version 1's table (the upgrade would add `spec` twice).
  const fs::path zero = dir.path() / "zero.db";
  { Journal journal(zero.string()); }
  Sql(zero, "PRAGMA user_version = 0");
  CHECK_THAT(OpenError(zero), Catch::Contains("says version 0, but its jobs table is not"));
  // A jobs table without a column its version has.
  const fs::path narrow = dir.path() / "narrow.db";
  { Journal journal(narrow.string()); }
  Sql(narrow, "ALTER TABLE jobs DROP COLUMN worker_host");
  CHECK_THAT(OpenError(narrow), Catch::Contains("its jobs table has no column `worker_host`"));
}

TEST_CASE(
    "a journal job whose spec is NULL or cannot be read is skipped, named, never "
    "dispatched",
    "[coordinator][journal][hostile]") {
  const testing::TempDir dir("journal-rows");
  const fs::path path = dir.path() / "j.db";
  {
    Journal journal(path.string());
    for (int64_t id = 1; id <= 4; ++id) journal.SaveJob(Record(id, "job" + std::to_string(id)));
  }
  Sql(path, "UPDATE jobs SET spec = NULL WHERE id = 2");
  // A 50,000-level table: the TOML parser crashed the coordinator at every start.
  std::string deep = "[a";
  for (int i = 0; i < 50000; ++i) deep += ".a";
  Sql(path, "UPDATE jobs SET spec = '" + deep + "]' WHERE id = 3");
  Sql(path, "UPDATE jobs SET state = 99 WHERE id = 4");
  {
    Journal journal(path.string());
    std::vector<std::string> skipped;
    const std::vector<JobRecord> jobs = journal.LoadJobs(&skipped);
    REQUIRE(jobs.size() == 1);
    CHECK(jobs[0].summary.id == 1);
    REQUIRE(skipped.size() == 3);
    CHECK_THAT(skipped[0], Catch::Contains("job 2 skipped"));
    CHECK_THAT(skipped[0], Catch::Contains("no spec (NULL)"));
    CHECK_THAT(skipped[1], Catch::Contains("job 3 skipped"));
    CHECK_THAT(skipped[1], Catch::Contains("nests deeper"));
    CHECK_THAT(skipped[2], Catch::Contains("job 4 skipped"));
    CHECK_THAT(skipped[2], Catch::Contains("state 99"));
    CHECK(journal.MaxJobId() == 4);
  }
  // The coordinator starts, dispatches job 1 alone, and gives a new job an unused id.
  CoordinatorOptions o;
  o.validator = NoProblems;
  Coordinator c(o, Journal(path.string()), 0);
  RegisterRequest w;
  w.host = "a";
  w.device = "cpu";
  w.stores = {{"tiny", "fp"}};
  const std::string worker = c.Register(w, 0).worker_id;
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{worker, {}, 1}, 1);
  REQUIRE(hb.has_assignment);
  CHECK(hb.assignment.job_id == 1);
  c.Finished(JobFinished{worker, 1, hb.assignment.attempt, JobOutcome::kSucceeded, "", "/a", 10},
             1);
  hb = c.Heartbeat(HeartbeatRequest{worker, {}, 1}, 2);
  CHECK_FALSE(hb.has_assignment);
  SubmitRequest r;
  r.spec = Record(0, "new").spec;
  r.spec_toml = "name = \"new\"\n";
  CHECK(c.Submit(r).job_id == 5);
  // The skipped rows are as they were.
  CHECK(SqlInt(path, "SELECT count(*) FROM jobs WHERE id = 2 AND spec IS NULL") == 1);
  CHECK(SqlInt(path, "SELECT state FROM jobs WHERE id = 4") == 99);
}
