// Issue 42 with real processes: `submit` refuses a job file nested 50,000 tables deep and a
// FIFO named as data.path at once, naming them (it crashed, and hung); a coordinator whose
// journal holds such a job starts, skipping that job with an error naming it (it crashed at
// every start).
#include <sqlite3.h>
#include <sys/stat.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "coordinator/daemon/journal.h"
#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::testing;
namespace fs = std::filesystem;

namespace {

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string DeepTable() {
  std::string deep = "[a";
  for (int i = 0; i < 50000; ++i) deep += ".a";
  return deep + "]\n";
}

}  // namespace

TEST_CASE("submit refuses a 50,000-level table and a FIFO as data.path at once, naming them",
          "[coordinator][cluster][hostile]") {
  Cluster c("hostile-submit");
  c.StartCoordinator();
  const std::string deep = c.WriteJob("deep", 5);
  std::ofstream(deep, std::ios::app) << DeepTable();
  int code = -1;
  c.Cli({"submit", deep}, &code, 30);
  CHECK(code == 4);  // corrupt input, not a signal
  std::string errors = ReadAll(c.dir() / "cli.stderr");
  CHECK_THAT(errors, Catch::Contains(deep) && Catch::Contains("nests deeper than 64 levels"));

  const std::string fifo = (c.dir() / "fifo.jsonl").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string job = (c.dir() / "fifo.toml").string();
  std::ofstream(job) << "name = \"fifo\"\n[model]\nstore = \"tiny\"\n[data]\npath = \"" << fifo
                     << "\"\n[train]\nsteps = 5\noutput_dir = \"" << (c.dir() / "out-fifo").string()
                     << "\"\n";
  const auto start = std::chrono::steady_clock::now();
  c.Cli({"submit", job}, &code, 30);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
  CHECK(code == 5);  // refused
  errors = ReadAll(c.dir() / "cli.stderr");
  INFO(errors);
  CHECK_THAT(errors, Catch::Contains(fifo) && Catch::Contains("it is a FIFO"));
  const std::string jobs = c.Cli({"jobs", "--json"}, &code);
  CHECK_THAT(jobs, !Catch::Contains("\"fifo\"") && !Catch::Contains("\"deep\""));
}

TEST_CASE("a coordinator whose journal holds an unreadable job starts and skips it by name",
          "[coordinator][cluster][hostile]") {
  Cluster c("hostile-journal");
  const fs::path db = c.dir() / "journal.db";
  {
    coordinator::Journal journal(db.string());
    for (int64_t id = 1; id <= 2; ++id) {
      coordinator::JobRecord job;
      job.summary.id = id;
      job.summary.name = "job" + std::to_string(id);
      job.summary.state = JobState::kQueued;
      job.summary.store_name = "tiny";
      job.spec.name = job.summary.name;
      job.spec.model.store = "tiny";
      job.spec.train.steps = 5;
      job.spec.train.output_dir = (c.dir() / ("out-" + job.summary.name)).string();
      journal.SaveJob(job);
    }
  }
  sqlite3* handle = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &handle) == SQLITE_OK);
  const std::string sql = "UPDATE jobs SET spec = '" + DeepTable() + "' WHERE id = 2";
  REQUIRE(sqlite3_exec(handle, sql.c_str(), nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(handle);

  c.StartCoordinator();
  int code = -1;
  const std::string jobs = c.Cli({"jobs", "--json"}, &code);
  CHECK(code == 0);
  CHECK_THAT(jobs, Catch::Contains("\"job1\"") && !Catch::Contains("\"job2\""));
  CHECK(c.coordinator().Running());
  CHECK_THAT(ReadAll(c.dir() / "coordinator.log"),
             Catch::Contains("job 2 skipped") && Catch::Contains("nests deeper"));
}
