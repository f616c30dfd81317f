// Pure pieces of the command: endpoint trust, durations, the watch view's frame and lines,
// statistics exports, the queue order.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "coordinator/cli/cli_format.h"
#include "coordinator/cli/watch_view.h"
#include "coordinator/client/curve.h"
#include "coordinator/daemon/scheduler.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::coordinator;
using namespace lorastream::cli;

TEST_CASE("only loopback and local endpoints count as local", "[coordinator]") {
  CHECK(IsLocalEndpoint("tcp://127.0.0.1:5757"));
  CHECK(IsLocalEndpoint("tcp://127.3.2.1:1"));
  CHECK(IsLocalEndpoint("tcp://localhost:5757"));
  CHECK(IsLocalEndpoint("tcp://[::1]:5757"));
  CHECK(IsLocalEndpoint("ipc:///tmp/x.sock"));
  CHECK_FALSE(IsLocalEndpoint("tcp://0.0.0.0:5757"));
  CHECK_FALSE(IsLocalEndpoint("tcp://*:5757"));
  CHECK_FALSE(IsLocalEndpoint("tcp://10.0.0.2:5757"));
  CHECK_FALSE(IsLocalEndpoint("tcp://127.0.0.1.evil.com:5757"));
  CHECK_FALSE(IsLocalEndpoint("tcp://eth0:5757"));
  CHECK_FALSE(IsLocalEndpoint("tcp://[::]:5757"));
}

TEST_CASE("the queue orders by priority then submission", "[coordinator]") {
  JobQueue q;
  q.Push(1, 0);
  q.Push(2, 5);
  q.Push(3, 5);
  q.Push(4, -1);
  CHECK(q.PickFirst([](int64_t) { return true; }) == 2);
  CHECK(q.PickFirst([](int64_t id) { return id != 2; }) == 3);
  CHECK(q.PickFirst([](int64_t id) { return id == 4; }) == 4);
  q.Remove(2, 5);
  CHECK(q.PickFirst([](int64_t) { return true; }) == 3);
  CHECK(q.PickFirst([](int64_t) { return false; }) == 0);
}

TEST_CASE("watch view: progress bar, ETA, loss, tokens/s, stall, H2D, workers", "[coordinator]") {
  WatchReply reply;
  JobSummary j;
  j.id = 3;
  j.name = "tiny-a";
  j.state = JobState::kRunning;
  j.step = 25;
  j.total_steps = 100;
  j.eta_seconds = 75;
  j.worker_host = "gpu1";
  j.worker_device = "cuda:0";
  j.has_stats = true;
  j.last_stats.loss = 2.3456;
  j.last_stats.tokens_per_second = 15321;
  j.last_stats.step_seconds = 0.5;
  j.last_stats.stall_seconds = 0.05;
  j.last_stats.h2d_bytes = 12'000'000'000ull;
  j.last_stats.h2d_busy_seconds = 1.0;
  reply.jobs.push_back(j);
  WorkerSummary w;
  w.host = "gpu1";
  w.device = "cuda:0";
  w.gpu_name = "NVIDIA H200";
  w.gpu_memory_bytes = 141ull << 30;
  w.job_ids = {3};
  reply.workers.push_back(w);
  std::string frame = RenderFrame(reply, {}, 120);
  CHECK_THAT(frame, Catch::Contains("step 25/100"));
  CHECK_THAT(frame, Catch::Contains("25%"));
  CHECK_THAT(frame, Catch::Contains("ETA 1:15"));
  CHECK_THAT(frame, Catch::Contains("loss 2.3456"));
  CHECK_THAT(frame, Catch::Contains("15321 tok/s"));
  CHECK_THAT(frame, Catch::Contains("stall 10.0%"));
  CHECK_THAT(frame, Catch::Contains("H2D 12.00 GB/s"));
  CHECK_THAT(frame, Catch::Contains("NVIDIA H200, 141.0 GiB"));
  std::string line = RenderLine(j);
  CHECK_THAT(line, Catch::StartsWith("job 3 tiny-a: running step 25/100 ETA 1:15"));
  CHECK(line.find('\n') == std::string::npos);
  CHECK(FormatDuration(3725) == "1:02:05");
  CHECK(FormatDuration(-1) == "-");
}

TEST_CASE("statistics export as CSV and JSON", "[coordinator]") {
  std::vector<StepStats> stats(2);
  stats[0].step = 1;
  stats[0].loss = 3.5;
  stats[1].step = 2;
  stats[1].loss = 3.25;
  std::string csv = StatsCsv(stats);
  CHECK_THAT(csv, Catch::StartsWith("step,total_steps,loss,"));
  CHECK_THAT(csv, Catch::Contains("\n2,0,3.25,"));
  nlohmann::json json = nlohmann::json::parse(StatsJson(7, stats));
  CHECK(json["job_id"] == 7);
  CHECK(json["stats"].size() == 2);
  CHECK(json["stats"][1]["loss"] == 3.25);
}

TEST_CASE("watch smooths tokens/s over steps; a repeated step or a new attempt is handled",
          "[coordinator]") {
  TokenRateSmoother smoother;
  auto shown = [&](int64_t step, double tps, int32_t attempt = 1) {
    WatchReply reply;
    JobSummary j;
    j.id = 7;
    j.state = JobState::kRunning;
    j.attempt = attempt;
    j.has_stats = true;
    j.last_stats.step = step;
    j.last_stats.tokens_per_second = tps;
    reply.jobs.push_back(j);
    smoother.Apply(reply);
    return reply.jobs[0].last_stats.tokens_per_second;
  };
  CHECK(shown(1, 100) == Approx(100));    // the start-up step, alone
  CHECK(shown(2, 1217) == Approx(1217));  // replaces it outright
  // The jumps (1217 -> 14581 -> 2722 tok/s) move the shown figure by a fifth each.
  const double after_jump = 0.8 * 1217 + 0.2 * 14581;
  CHECK(shown(3, 14581) == Approx(after_jump));
  CHECK(shown(3, 14581) == Approx(after_jump));  // the same step seen again: no change
  CHECK(shown(4, 2722) == Approx(0.8 * after_jump + 0.2 * 2722));
  CHECK(shown(1, 500, 2) == Approx(500));  // a requeued job's new attempt starts afresh
}
