// Evaluation losses through the coordinator's statistics path: kept by the downsampling,
// summarised (last and lowest) for show/watch, stored in the journal (NULL on the other steps,
// older journals gain the columns), exported by `stats` and handed to the statistics sink.
#include <sqlite3.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>

#include "coordinator/cli/cli_format.h"
#include "coordinator/cli/watch_view.h"
#include "coordinator/daemon/coordinator.h"

using namespace lorastream;
using namespace lorastream::coordinator;
using namespace lorastream::cli;
namespace fs = std::filesystem;

namespace {

struct TempDb {
  fs::path dir = fs::temp_directory_path() / ("lorastream-eval-test-" + std::to_string(getpid()));
  TempDb() {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDb() { fs::remove_all(dir); }
  std::string path() const { return (dir / "j.db").string(); }
};

CoordinatorOptions Options() {
  CoordinatorOptions o;
  o.validator = [](const JobSpec&) { return std::vector<std::string>{}; };
  o.stats_rows_per_job = 10;  // 1000 steps: every 100th is kept, plus the evaluations
  return o;
}

StepStats Step(int64_t step, double eval_loss = std::nan("")) {
  StepStats s;
  s.step = step;
  s.total_steps = 1000;
  s.loss = 10.0 / static_cast<double>(step);
  s.eval_loss = eval_loss;
  s.eval_tokens = std::isnan(eval_loss) ? 0 : 64;
  return s;
}

}  // namespace

TEST_CASE("eval losses reach show, watch and stats, survive downsampling and restarts",
          "[coordinator]") {
  TempDb db;
  std::vector<std::pair<int64_t, StepStats>> sunk;
  CoordinatorOptions options = Options();
  options.on_stats = [&](const JobSummary& job, const StepStats& s) {
    sunk.emplace_back(job.id, s);
  };
  int64_t id = 0;
  {
    Coordinator c(options, Journal(db.path()), 0);
    SubmitRequest req;
    req.spec.name = "e";
    req.spec.model.store = "tiny";
    req.spec.train.steps = 1000;
    req.spec.train.output_dir = "/tmp/out-e";
    id = c.Submit(req).job_id;
    RegisterRequest worker;
    worker.host = "h";
    worker.device = "cpu";
    worker.stores = {{"tiny", ""}};
    std::string w = c.Register(worker, 0).worker_id;
    REQUIRE(c.Heartbeat(HeartbeatRequest{w, {}, 1}, 0).assignment.job_id == id);
    for (int64_t step = 1; step <= 250; ++step) {
      // Evaluations at 37 and 74 (not multiples of the stride 100), lowest at 74.
      double eval = step == 37 ? 2.5 : step == 74 ? 1.75 : step == 111 ? 2.0 : std::nan("");
      c.Step(StepReport{w, id, 1, Step(step, eval)}, 1);
    }
    JobSummary s = c.ShowJob(ShowJobRequest{id}, 1).job;
    CHECK(s.last_eval_step == 111);
    CHECK(s.last_eval_loss == 2.0);
    CHECK(s.best_eval_step == 74);
    CHECK(s.best_eval_loss == 1.75);
    CHECK(sunk.size() == 250);
    CHECK(sunk[36].second.eval_loss == 2.5);
    CHECK(sunk[35].second.has_eval() == false);

    std::vector<StepStats> rows = c.Stats(StatsRequest{id}).stats;
    std::vector<int64_t> steps;
    for (const StepStats& x : rows) steps.push_back(x.step);
    CHECK(steps == std::vector<int64_t>{1, 37, 74, 100, 111, 200, 250});
    const std::string csv = StatsCsv(rows);
    CHECK_THAT(csv, Catch::Contains(",eval_loss,eval_tokens\n"));
    CHECK_THAT(csv, Catch::Contains(",1.75,64\n"));
    CHECK_THAT(csv, Catch::Contains("\n100,1000,0.1,"));
    CHECK_THAT(csv, Catch::EndsWith(",0,,\n"));  // step 250: no evaluation, empty cells
    nlohmann::json json = nlohmann::json::parse(StatsJson(id, rows));
    CHECK(json["stats"][2]["eval_loss"] == 1.75);
    CHECK_FALSE(json["stats"][3].contains("eval_loss"));

    ShowJobReply shown = c.ShowJob(ShowJobRequest{id}, 1);
    const std::string details = JobDetails(shown, "/tmp/out-e/checkpoint-74");
    CHECK_THAT(details,
               Catch::Contains("eval loss:   2.0000 at step 111 (lowest 1.7500 at step 74)"));
    CHECK_THAT(details, Catch::Contains("best:        /tmp/out-e/checkpoint-74"));
    CHECK_THAT(details, !Catch::Contains("best adapter"));
    CHECK_THAT(JobDetails(shown, "/tmp/out-e/checkpoint-74", "/tmp/out-e/best"),
               Catch::Contains("best:        /tmp/out-e/checkpoint-74\n  best adapter: "
                               "/tmp/out-e/best"));
    CHECK(ToJson(shown.job)["best_eval_step"] == 74);
    CHECK_THAT(RenderLine(shown.job), Catch::Contains("eval 2.0000 @111"));
  }
  // A restart takes the evaluations back from the journal's statistics.
  Coordinator again(Options(), Journal(db.path()), 10);
  JobSummary s = again.ShowJob(ShowJobRequest{id}, 10).job;
  CHECK(s.last_eval_step == 111);
  CHECK(s.best_eval_step == 74);
  CHECK(s.best_eval_loss == 1.75);
  std::vector<StepStats> rows = again.Stats(StatsRequest{id}).stats;
  REQUIRE(rows.size() >= 5);
  CHECK(std::isnan(rows[0].eval_loss));  // NULL in the journal, NaN again
  CHECK(rows[1].eval_loss == 2.5);
}

TEST_CASE("a journal from before evaluations opens and its statistics gain the columns",
          "[coordinator]") {
  TempDb db;
  {  // tests/fixtures' version-0 journal, its statistics as they were before evaluations
    std::filesystem::copy_file(
        std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/journal-19d7a07/journal.db",
        db.path());
    sqlite3* raw = nullptr;
    REQUIRE(sqlite3_open(db.path().c_str(), &raw) == SQLITE_OK);
    const char* old_schema =
        "DROP TABLE stats;"
        "CREATE TABLE stats (job_id INTEGER, step INTEGER, attempt INTEGER, total_steps "
        "INTEGER, loss REAL, learning_rate REAL, grad_norm REAL, tokens INTEGER, step_seconds "
        "REAL, tokens_per_second REAL, h2d_bytes INTEGER, h2d_busy_seconds REAL, stall_seconds "
        "REAL, copies INTEGER, copies_saved INTEGER, peak_device_bytes INTEGER, PRIMARY KEY "
        "(job_id, step));"
        "INSERT INTO stats VALUES (4, 1, 1, 2, 3.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);";
    REQUIRE(sqlite3_exec(raw, old_schema, nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(raw);
  }
  Journal j(db.path());
  std::vector<StepStats> rows = j.LoadStats(4);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].loss == 3.5);
  CHECK(std::isnan(rows[0].eval_loss));
  j.AppendStats(4, 1, Step(2, 0.5));
  rows = j.LoadStats(4);
  REQUIRE(rows.size() == 2);
  CHECK(rows[1].eval_loss == 0.5);
  CHECK(rows[1].eval_tokens == 64);
}
