// Multi-process tests with real sockets: a `lorastream coordinator` process, test-driver
// worker processes and the `lorastream` command.
#include <catch2/catch.hpp>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::testing;

namespace {

// "attempt pid step group" lines of a job's steps.log -> attempt -> steps it ran.
std::map<int, std::vector<int64_t>> StepsByAttempt(const std::string& log) {
  std::map<int, std::vector<int64_t>> out;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream in(line);
    int attempt;
    long pid;
    int64_t step;
    if (in >> attempt >> pid >> step) out[attempt].push_back(step);
  }
  return out;
}

}  // namespace

TEST_CASE("cluster: queue order by priority then submission, and model affinity",
          "[coordinator][cluster]") {
  Cluster c("order");
  c.StartCoordinator();
  int64_t low = c.Submit(c.WriteJob("low", 4, 0, 0));
  int64_t high1 = c.Submit(c.WriteJob("high1", 4, 0, 5));
  int64_t qwen = c.Submit(c.WriteJob("qwen", 4, 0, 9, "qwen"));
  int64_t high2 = c.Submit(c.WriteJob("high2", 4, 0, 5));
  c.StartWorker("hosta", {"tiny:fp-tiny"}, 10);
  REQUIRE(c.WaitState(low, JobState::kSucceeded, 30));
  JobSummary l = c.Job(low), h1 = c.Job(high1), h2 = c.Job(high2);
  CHECK(h1.started_at < h2.started_at);
  CHECK(h2.started_at < l.started_at);
  CHECK(h1.worker_host == "hosta");
  CHECK(c.ReadOutput("high2", "adapter") == "completed 4\n");
  // Nobody has the qwen store yet.
  CHECK(c.Job(qwen).state == JobState::kQueued);
  c.StartWorker("hostq", {"qwen:fp-q"}, 10);
  REQUIRE(c.WaitState(qwen, JobState::kSucceeded, 30));
  CHECK(c.Job(qwen).worker_host == "hostq");

  int code = -1;
  std::string jobs = c.Cli({"jobs", "--json"}, &code);
  CHECK(code == 0);
  CHECK(nlohmann::json::parse(jobs).size() == 4);
  std::string workers = c.Cli({"workers"}, &code);
  CHECK(code == 0);
  CHECK_THAT(workers, Catch::Contains("hostq"));
  std::string csv = c.Cli({"stats", std::to_string(low), "--format", "csv"}, &code);
  CHECK(code == 0);
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 5);  // header + 4 steps
}

TEST_CASE("cluster: cancel stops a running job at a step boundary with its adapter saved",
          "[coordinator][cluster]") {
  Cluster c("cancel");
  c.StartCoordinator();
  c.StartWorker("hosta", {"tiny:"}, 20);
  int64_t id = c.Submit(c.WriteJob("long", 100000, 10));
  REQUIRE(WaitFor([&] { return c.Job(id).step >= 3; }, 30));
  int code = -1;
  std::string out = c.Cli({"cancel", std::to_string(id)}, &code);
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("cancel requested"));
  REQUIRE(c.WaitState(id, JobState::kCancelled, 20));
  JobSummary s = c.Job(id);
  CHECK_THAT(c.ReadOutput("long", "adapter"), Catch::StartsWith("stopped at "));
  CHECK_THAT(s.reason, Catch::Contains("cancelled at step"));
  CHECK(s.step < 100000);
  // watch on an ended, cancelled job returns at once with status 1.
  std::string watch = c.Cli({"watch", std::to_string(id)}, &code, 20);
  CHECK(code == 1);
  CHECK_THAT(watch, Catch::Contains("cancelled"));
  // The worker is free again.
  int64_t next = c.Submit(c.WriteJob("next", 3));
  CHECK(c.WaitState(next, JobState::kSucceeded, 30));
}

TEST_CASE("cluster: a job that fails on its worker shows every problem of the error",
          "[coordinator][cluster]") {
  Cluster c("fail");
  c.StartCoordinator();
  c.StartWorker("hosta", {"tiny:"}, 5, {"--fail-at-step", "2"});
  int64_t id = c.Submit(c.WriteJob("bad", 10));
  REQUIRE(c.WaitState(id, JobState::kFailed, 30));
  CHECK(c.Job(id).reason == "test failure at step 2: first problem; second problem");
  int code = -1;
  std::string shown = c.Cli({"show", std::to_string(id)}, &code);
  CHECK_THAT(shown, Catch::Contains("first problem; second problem"));
}

TEST_CASE("cluster: a worker killed with SIGKILL mid-job -> the job finishes on another",
          "[coordinator][cluster]") {
  Cluster c("sigkill");
  c.StartCoordinator();
  Subprocess& a = c.StartWorker("hosta", {"tiny:fp"}, 40);
  int64_t id = c.Submit(c.WriteJob("victim", 40, 5));
  REQUIRE(WaitFor([&] { return c.Job(id).step >= 12; }, 30));
  // Only now a second worker: the job cannot have started there.
  c.StartWorker("hostb", {"tiny:fp"}, 40);
  Subprocess watch = Subprocess::Spawn(
      {Bin("lorastream"), "--coordinator", c.endpoint(), "watch", std::to_string(id)},
      LogTo((c.dir() / "watch.log").string()));
  JobSummary before = c.Job(id);
  CHECK(before.worker_host == "hosta");
  a.Signal(SIGKILL);
  REQUIRE(c.WaitState(id, JobState::kSucceeded, 40));
  JobSummary after = c.Job(id);
  CHECK(after.attempt == 2);
  CHECK(after.worker_host == "hostb");
  CHECK(c.ReadOutput("victim", "adapter") == "completed 40\n");
  auto steps = StepsByAttempt(c.ReadOutput("victim", "steps.log"));
  REQUIRE(steps.count(1));
  REQUIRE(steps.count(2));
  // The second attempt resumed right after a checkpoint of the first (a multiple of 5 no
  // later than where the first attempt got), not from scratch.
  int64_t resumed_at = steps[2].front();
  CHECK(resumed_at > 1);
  CHECK((resumed_at - 1) % 5 == 0);
  CHECK(resumed_at - 1 <= steps[1].back());
  CHECK(steps[2].back() == 40);
  CHECK(watch.Wait(20) == 0);
  std::ifstream wl(c.dir() / "watch.log");
  std::string watch_log((std::istreambuf_iterator<char>(wl)), std::istreambuf_iterator<char>());
  CHECK_THAT(watch_log, Catch::Contains("succeeded"));
  CHECK_THAT(watch_log, Catch::Contains("requeued"));
}

TEST_CASE(
    "cluster: coordinator killed and restarted mid-run -> every job still there and "
    "finishing",
    "[coordinator][cluster]") {
  Cluster c("restart");
  c.StartCoordinator();
  c.StartWorker("hosta", {"tiny:fp"}, 40);
  c.StartWorker("hostb", {"tiny:fp"}, 40);
  int64_t j1 = c.Submit(c.WriteJob("j1", 40, 5, 2));
  int64_t j2 = c.Submit(c.WriteJob("j2", 40, 5, 1));
  int64_t j3 = c.Submit(c.WriteJob("j3", 10, 5, 0));
  REQUIRE(WaitFor([&] { return c.Job(j1).step >= 5 && c.Job(j2).step >= 5; }, 30));
  CHECK(c.Job(j3).state == JobState::kQueued);
  // A `watch` of every job rides through the restart.
  Subprocess watch = Subprocess::Spawn({Bin("lorastream"), "--coordinator", c.endpoint(), "watch"},
                                       LogTo((c.dir() / "watch.log").string()));
  REQUIRE(WaitFor([&] { return c.Log("watch").find("j1") != std::string::npos; }, 30));
  // Steps the two running jobs have written (one line each in their steps.log).
  auto steps_written = [&] {
    size_t lines = 0;
    for (const char* job : {"j1", "j2"}) {
      const std::string log = c.ReadOutput(job, "steps.log");
      lines += static_cast<size_t>(std::count(log.begin(), log.end(), '\n'));
    }
    return lines;
  };
  c.coordinator().Signal(SIGKILL);
  CHECK(c.coordinator().Wait(10) == 128 + SIGKILL);
  // The workers train on while the coordinator is down (unless both jobs were done already).
  const size_t at_kill = steps_written();
  REQUIRE(WaitFor([&] { return steps_written() > at_kill || at_kill == 80; }, 30));
  c.StartCoordinator();
  Client client = c.NewClient();
  ListJobsReply jobs = client.Call(ListJobsRequest{});
  REQUIRE(jobs.jobs.size() == 3);
  for (int64_t id : {j1, j2, j3}) CHECK(c.WaitState(id, JobState::kSucceeded, 60));
  // The two running jobs kept their workers (reconciled at re-registration, not requeued).
  INFO(c.Log("coordinator") << c.Log("worker-hosta") << c.Log("worker-hostb")
                            << c.ReadOutput("j2", "steps.log"));
  CHECK(c.Job(j1).attempt == 1);
  CHECK(c.Job(j2).attempt == 1);
  CHECK(c.ReadOutput("j1", "adapter") == "completed 40\n");
  CHECK(StepsByAttempt(c.ReadOutput("j2", "steps.log"))[1].size() == 40);
  CHECK(client.Call(StatsRequest{j1}).stats.back().step == 40);
  CHECK(watch.Wait(30) == 0);
}
