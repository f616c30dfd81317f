// Job slots across real processes (coordinator, test-driver workers with --jobs): two jobs
// stepping together in one worker's group, one failing alone, a 2-slot worker killed mid-run
// whose jobs both resume from their checkpoints elsewhere, a coordinator restarted under a
// 2-slot worker, and `lorastream workers`.
#include <catch2/catch.hpp>

#include <signal.h>

#include <map>
#include <sstream>

#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::testing;

namespace {

struct Line {
  int attempt = 0;
  int64_t step = 0;
  int group = 0;
};

// "attempt pid step group" lines of a job's steps.log.
std::vector<Line> Lines(const std::string& log) {
  std::vector<Line> out;
  std::istringstream lines(log);
  for (std::string text; std::getline(lines, text);) {
    std::istringstream in(text);
    Line line;
    long pid = 0;
    if (in >> line.attempt >> pid >> line.step >> line.group) out.push_back(line);
  }
  return out;
}

bool SteppedInGroupOf(const std::vector<Line>& lines, int size) {
  for (const Line& l : lines)
    if (l.group == size) return true;
  return false;
}

}  // namespace

TEST_CASE("slots cluster: two jobs train as one group of a 2-slot worker; one fails alone",
          "[coordinator][cluster][slots]") {
  Cluster c("slots-group");
  c.StartCoordinator();
  // 50 ms a step: job a (20 steps) is still running when `workers` lists its two busy slots,
  // also under a sanitizer's slowdown.
  c.StartWorker("hosta", {"tiny:fp"}, 50, {"--jobs", "2", "--fail-at-step", "30"});
  const int64_t a = c.Submit(c.WriteJob("a", 20, 5));
  const int64_t b = c.Submit(c.WriteJob("b", 60, 5));  // fails at step 30, alone
  REQUIRE(WaitFor([&] { return c.Job(a).step >= 3 && c.Job(b).step >= 3; }, 30));
  int code = -1;
  const std::string workers = c.Cli({"workers"}, &code);
  CHECK(code == 0);
  CHECK_THAT(workers, Catch::Contains("2/2"));
  REQUIRE(c.WaitState(a, JobState::kSucceeded, 30));
  REQUIRE(c.WaitState(b, JobState::kFailed, 30));
  INFO(c.Log("worker-hosta"));
  CHECK_THAT(c.Job(b).reason, Catch::Contains("test failure at step 30"));
  const std::vector<Line> la = Lines(c.ReadOutput("a", "steps.log"));
  REQUIRE(la.size() == 20);
  CHECK(SteppedInGroupOf(la, 2));
  // After a finished, b trained on alone until its failure: a's end freed its slot.
  const std::vector<Line> lb = Lines(c.ReadOutput("b", "steps.log"));
  REQUIRE(lb.size() == 29);
  CHECK(lb.back().group == 1);
  // Statistics stay per job.
  client::Client client = c.NewClient();
  CHECK(client.Call(StatsRequest{a}).stats.back().step == 20);
  CHECK(client.Call(StatsRequest{b}).stats.back().step == 29);
  // The freed slots take the next jobs.
  const int64_t next = c.Submit(c.WriteJob("next", 3));
  CHECK(c.WaitState(next, JobState::kSucceeded, 30));
}

TEST_CASE("slots cluster: a 2-slot worker killed mid-run -> both jobs resume elsewhere",
          "[coordinator][cluster][slots]") {
  Cluster c("slots-kill");
  c.StartCoordinator();
  Subprocess& victim = c.StartWorker("hosta", {"tiny:fp"}, 40, {"--jobs", "2"});
  const int64_t a = c.Submit(c.WriteJob("a", 40, 5));
  const int64_t b = c.Submit(c.WriteJob("b", 40, 4));
  REQUIRE(
      WaitFor([&] { return c.Job(a).checkpoint_step >= 5 && c.Job(b).checkpoint_step >= 8; }, 30));
  REQUIRE(c.Job(a).worker_host == "hosta");
  REQUIRE(c.Job(b).worker_host == "hosta");
  // Only now a second worker: neither job can have started there.
  c.StartWorker("hostb", {"tiny:fp"}, 40, {"--jobs", "2"});
  victim.Signal(SIGKILL);
  REQUIRE(c.WaitState(a, JobState::kSucceeded, 60));
  REQUIRE(c.WaitState(b, JobState::kSucceeded, 60));
  INFO(c.Log("coordinator") << c.Log("worker-hostb"));
  for (const auto& [name, id, every] : {std::tuple{"a", a, 5}, std::tuple{"b", b, 4}}) {
    const JobSummary s = c.Job(id);
    CHECK(s.attempt == 2);
    CHECK(s.worker_host == "hostb");
    CHECK(c.ReadOutput(name, "adapter") == "completed 40\n");
    std::map<int, std::vector<int64_t>> steps;
    for (const Line& l : Lines(c.ReadOutput(name, "steps.log"))) steps[l.attempt].push_back(l.step);
    REQUIRE(steps.count(1));
    REQUIRE(steps.count(2));
    // Each resumed right after a checkpoint of its own first attempt, not from scratch.
    const int64_t resumed_at = steps[2].front();
    CHECK(resumed_at > 1);
    CHECK((resumed_at - 1) % every == 0);
    CHECK(resumed_at - 1 <= steps[1].back());
    CHECK(steps[2].back() == 40);
    CHECK(SteppedInGroupOf(Lines(c.ReadOutput(name, "steps.log")), 2));
  }
}

TEST_CASE("slots cluster: a coordinator restarted under a 2-slot worker; it keeps both jobs",
          "[coordinator][cluster][slots]") {
  Cluster c("slots-restart");
  c.StartCoordinator();
  c.StartWorker("hosta", {"tiny:fp"}, 30, {"--jobs", "2"});
  const int64_t a = c.Submit(c.WriteJob("a", 60, 5));
  const int64_t b = c.Submit(c.WriteJob("b", 60, 5));
  REQUIRE(WaitFor([&] { return c.Job(a).step >= 5 && c.Job(b).step >= 5; }, 30));
  c.coordinator().Signal(SIGKILL);
  CHECK(c.coordinator().Wait(10) == 128 + SIGKILL);
  c.StartCoordinator();
  REQUIRE(c.WaitState(a, JobState::kSucceeded, 60));
  REQUIRE(c.WaitState(b, JobState::kSucceeded, 60));
  INFO(c.Log("coordinator") << c.Log("worker-hosta"));
  // Both kept their worker (reconciled at re-registration, not requeued) and ran every step
  // in their first attempt.
  for (const auto& [name, id] : {std::pair{"a", a}, std::pair{"b", b}}) {
    CHECK(c.Job(id).attempt == 1);
    const std::vector<Line> lines = Lines(c.ReadOutput(name, "steps.log"));
    CHECK(lines.size() == 60);
    for (const Line& l : lines) CHECK(l.attempt == 1);
  }
  CHECK_THAT(c.Log("worker-hosta"), Catch::Contains("keeping 2 running jobs"));
}
