// The coordinator's logic without sockets: queue order, model affinity, ownership of reports,
// cancel, dead workers, retry limit, and a restart from the journal.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>

#include "coordinator/daemon/coordinator.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using namespace lorastream::coordinator;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> NoProblems(const JobSpec&) { return {}; }

CoordinatorOptions Options() {
  CoordinatorOptions o;
  o.heartbeat_timeout_s = 5;
  o.max_retries = 1;
  o.validator = NoProblems;
  return o;
}

SubmitRequest Job(const std::string& name, int priority, const std::string& store = "tiny") {
  SubmitRequest r;
  r.spec.name = name;
  r.spec.priority = priority;
  r.spec.model.store = store;
  r.spec.train.steps = 10;
  r.spec.train.output_dir = "/tmp/out-" + name;
  r.spec.source = name + ".toml";
  r.spec_toml = "name = \"" + name + "\"\n";
  return r;
}

RegisterRequest Worker(const std::string& host, std::vector<StoreInfo> stores) {
  RegisterRequest r;
  r.host = host;
  r.device = "cpu";
  r.stores = std::move(stores);
  return r;
}

struct TempDb {
  testing::TempDir dir{"coord"};
  std::string path() const { return dir / "j.db"; }
};

const JobSummary& FindJob(const ListJobsReply& r, int64_t id) {
  for (const JobSummary& j : r.jobs)
    if (j.id == id) return j;
  FAIL("no job " << id);
  return r.jobs.front();
}

}  // namespace

TEST_CASE("queue order is priority, then submission; only hosts with the model", "[coordinator]") {
  TempDb db;
  Coordinator c(Options(), Journal(db.path()), 0);
  int64_t low = c.Submit(Job("low", 0)).job_id;
  int64_t high1 = c.Submit(Job("high1", 5)).job_id;
  int64_t other = c.Submit(Job("other", 9, "qwen")).job_id;
  int64_t high2 = c.Submit(Job("high2", 5)).job_id;

  std::string w = c.Register(Worker("a", {{"tiny", "fp-a"}}), 0).worker_id;
  std::vector<int64_t> order;
  for (int i = 0; i < 3; ++i) {
    HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{w, {}, 1}, 1);
    REQUIRE(hb.has_assignment);
    order.push_back(hb.assignment.job_id);
    c.Finished(JobFinished{w, hb.assignment.job_id, hb.assignment.attempt, JobOutcome::kSucceeded,
                           "", "/a", 10},
               1);
  }
  CHECK(order == std::vector<int64_t>{high1, high2, low});
  // The qwen job waits: no worker has that store.
  CHECK_FALSE(c.Heartbeat(HeartbeatRequest{w, {}, 1}, 2).has_assignment);
  ListJobsReply jobs = c.ListJobs(ListJobsRequest{true}, 2);
  CHECK(FindJob(jobs, other).state == JobState::kQueued);
  CHECK(FindJob(jobs, other).reason == "waiting for a worker offering store `qwen`");
  CHECK(FindJob(jobs, low).fingerprint == "fp-a");  // pinned at the first run

  std::string q = c.Register(Worker("b", {{"qwen", "fp-q"}}), 2).worker_id;
  CHECK(c.ShowJob(ShowJobRequest{other}, 2).job.reason.empty());  // a worker can take it now
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{q, {}, 1}, 3);
  REQUIRE(hb.has_assignment);
  CHECK(hb.assignment.job_id == other);
  CHECK(hb.assignment.spec.model.store == "qwen");
}

TEST_CASE("a resumed job only goes to a host with the same base fingerprint", "[coordinator]") {
  TempDb db;
  Coordinator c(Options(), Journal(db.path()), 0);
  int64_t id = c.Submit(Job("j", 0)).job_id;
  std::string a = c.Register(Worker("a", {{"tiny", "fp-1"}}), 0).worker_id;
  REQUIRE(c.Heartbeat(HeartbeatRequest{a, {}, 1}, 0).assignment.job_id == id);
  c.Tick(10);  // a is silent for 10 s > 5 s: dead, job requeued
  std::string b = c.Register(Worker("b", {{"tiny", "fp-2"}}), 10).worker_id;
  CHECK_FALSE(c.Heartbeat(HeartbeatRequest{b, {}, 1}, 10).has_assignment);
  std::string d = c.Register(Worker("d", {{"tiny", "fp-1"}}), 10).worker_id;
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{d, {}, 1}, 10);
  REQUIRE(hb.has_assignment);
  CHECK(hb.assignment.attempt == 2);
}

TEST_CASE("a worker can report only on its own job", "[coordinator]") {
  TempDb db;
  Coordinator c(Options(), Journal(db.path()), 0);
  int64_t id = c.Submit(Job("j", 0)).job_id;
  std::string a = c.Register(Worker("a", {{"tiny", ""}}), 0).worker_id;
  std::string b = c.Register(Worker("b", {{"tiny", ""}}), 0).worker_id;
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{a, {}, 1}, 0);
  REQUIRE(hb.assignment.job_id == id);
  StepReport step{b, id, 1, {}};
  step.stats.step = 1;
  CHECK_THROWS_WITH(c.Step(step, 1), Catch::Contains("does not run job"));
  CHECK_THROWS_WITH(c.Finished(JobFinished{b, id, 1, JobOutcome::kSucceeded, "", "", 1}, 1),
                    Catch::Contains("does not run job"));
  CHECK_THROWS_WITH(c.Step(StepReport{"w-forged", id, 1, {}}, 1), Catch::Contains("unknown"));
  StepReport wrong_attempt{a, id, 2, {}};
  CHECK_THROWS_AS(c.Step(wrong_attempt, 1), Error);
  step.worker_id = a;
  CHECK_NOTHROW(c.Step(step, 1));
  CHECK(c.ShowJob(ShowJobRequest{id}, 1).job.step == 1);
}

TEST_CASE("cancel: queued at once, running at the next step boundary", "[coordinator]") {
  TempDb db;
  Coordinator c(Options(), Journal(db.path()), 0);
  int64_t run = c.Submit(Job("run", 1)).job_id;
  int64_t wait = c.Submit(Job("wait", 0)).job_id;
  std::string w = c.Register(Worker("a", {{"tiny", ""}}), 0).worker_id;
  REQUIRE(c.Heartbeat(HeartbeatRequest{w, {}, 1}, 0).assignment.job_id == run);
  CHECK(c.Cancel(CancelRequest{wait}).state == JobState::kCancelled);
  CHECK(c.Cancel(CancelRequest{run}).state == JobState::kRunning);
  StepReport step{w, run, 1, {}};
  step.stats.step = 3;
  CHECK(c.Step(step, 1).stop_job);
  CHECK(c.Heartbeat(HeartbeatRequest{w, {{run, 1}}, 0}, 1).stop_jobs == std::vector<int64_t>{run});
  c.Finished(JobFinished{w, run, 1, JobOutcome::kCancelled, "", "/out/adapter", 3}, 1);
  JobSummary s = c.ShowJob(ShowJobRequest{run}, 1).job;
  CHECK(s.state == JobState::kCancelled);
  CHECK_THAT(s.reason, Catch::Contains("step 3"));
  CHECK(s.adapter_path == "/out/adapter");
  CHECK_THROWS_AS(c.Cancel(CancelRequest{run}), Error);
  CHECK_THROWS_AS(c.Cancel(CancelRequest{999}), Error);
}

TEST_CASE("a job submitted with a client key is cancelled only with that key, across restarts",
          "[coordinator]") {
  TempDb db;
  int64_t owned = 0, open = 0;
  {
    Coordinator c(Options(), Journal(db.path()), 0);
    owned = c.Submit(Job("owned", 0), "KEY-A").job_id;
    open = c.Submit(Job("open", 0)).job_id;  // no CURVE: no owner
  }
  Coordinator c(Options(), Journal(db.path()), 0);  // the owner survives the journal
  try {
    c.Cancel(CancelRequest{owned}, "KEY-B");
    FAIL("another key cancelled the job");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK_THAT(e.what(), Catch::Contains("another client key"));
  }
  CHECK(c.ShowJob(ShowJobRequest{owned}, 0).job.state == JobState::kQueued);
  CHECK(c.Cancel(CancelRequest{owned}, "KEY-A").state == JobState::kCancelled);
  CHECK(c.Cancel(CancelRequest{open}, "KEY-B").state == JobState::kCancelled);
  // Restarted without CURVE (loopback, no key): the operator can cancel anyone's job.
  int64_t other = c.Submit(Job("other", 0), "KEY-A").job_id;
  CHECK(c.Cancel(CancelRequest{other}).state == JobState::kCancelled);
}

TEST_CASE("dead workers requeue their job from its checkpoint, up to the retry limit",
          "[coordinator]") {
  TempDb db;
  Coordinator c(Options(), Journal(db.path()), 0);  // max_retries = 1
  int64_t id = c.Submit(Job("j", 0)).job_id;
  std::string a = c.Register(Worker("a", {{"tiny", ""}}), 0).worker_id;
  REQUIRE(c.Heartbeat(HeartbeatRequest{a, {}, 1}, 0).has_assignment);
  c.Checkpoint(CheckpointReport{a, id, 1, 4, "/out/checkpoint-4"}, 1);
  c.Tick(4);  // 4 s of silence: still alive
  CHECK(c.ShowJob(ShowJobRequest{id}, 4).job.state == JobState::kRunning);
  c.Tick(7);
  JobSummary s = c.ShowJob(ShowJobRequest{id}, 7).job;
  CHECK(s.state == JobState::kQueued);
  CHECK_THAT(s.reason, Catch::Contains("died"));

  std::string b = c.Register(Worker("b", {{"tiny", ""}}), 7).worker_id;
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{b, {}, 1}, 7);
  REQUIRE(hb.has_assignment);
  CHECK(hb.assignment.resume_step == 4);
  CHECK(hb.assignment.checkpoint_path == "/out/checkpoint-4");
  // The dead worker's late report is refused.
  CHECK_THROWS_AS(c.Step(StepReport{a, id, 1, {}}, 8), Error);
  c.Tick(20);  // b dies too: the second death exceeds max_retries = 1
  s = c.ShowJob(ShowJobRequest{id}, 20).job;
  CHECK(s.state == JobState::kFailed);
  CHECK_THAT(s.reason, Catch::Contains("gave up after 1 retries"));
}

TEST_CASE("a restarted coordinator keeps every job and reconciles running ones", "[coordinator]") {
  TempDb db;
  int64_t queued, running, orphan;
  std::string w1, w2;
  {
    Coordinator c(Options(), Journal(db.path()), 0);
    running = c.Submit(Job("running", 2)).job_id;
    orphan = c.Submit(Job("orphan", 1)).job_id;
    queued = c.Submit(Job("queued", 0)).job_id;
    w1 = c.Register(Worker("a", {{"tiny", ""}}), 0).worker_id;
    w2 = c.Register(Worker("b", {{"tiny", ""}}), 0).worker_id;
    REQUIRE(c.Heartbeat(HeartbeatRequest{w1, {}, 1}, 0).assignment.job_id == running);
    REQUIRE(c.Heartbeat(HeartbeatRequest{w2, {}, 1}, 0).assignment.job_id == orphan);
    StepReport step{w1, running, 1, {}};
    step.stats.step = 1;
    step.stats.total_steps = 10;
    c.Step(step, 1);
  }
  Coordinator c(Options(), Journal(db.path()), 100);
  ListJobsReply jobs = c.ListJobs(ListJobsRequest{true}, 100);
  REQUIRE(jobs.jobs.size() == 3);
  CHECK(FindJob(jobs, queued).state == JobState::kQueued);
  CHECK(FindJob(jobs, running).state == JobState::kRunning);
  // The coordinator forgot the workers: heartbeats say so, and w1 comes back with its job.
  CHECK_FALSE(c.Heartbeat(HeartbeatRequest{w1, {{running, 1}}, 0}, 100).known_worker);
  RegisterRequest again = Worker("a", {{"tiny", ""}});
  again.previous_worker_id = w1;
  again.running = {{running, 1}};
  RegisterReply rr = c.Register(again, 101);
  CHECK(rr.kept_jobs == std::vector<int64_t>{running});
  CHECK(rr.worker_id == w1);
  // A forged claim on the orphan is not honoured.
  RegisterRequest forged = Worker("x", {{"tiny", ""}});
  forged.previous_worker_id = "w-forged";
  forged.running = {{orphan, 1}};
  CHECK(c.Register(forged, 101).kept_jobs.empty());
  // w2 never returns: after the reconcile timeout its job is requeued.
  c.Tick(103);
  CHECK(c.ShowJob(ShowJobRequest{orphan}, 103).job.state == JobState::kRunning);
  c.Tick(106);
  JobSummary o = c.ShowJob(ShowJobRequest{orphan}, 106).job;
  CHECK(o.state == JobState::kQueued);
  CHECK_THAT(o.reason, Catch::Contains("coordinator restart"));
  CHECK(c.Stats(StatsRequest{running}).stats.size() == 1);
  // New ids continue after the journal's.
  CHECK(c.Submit(Job("next", 0)).job_id == queued + 1);
}

TEST_CASE("submit returns every problem and refuses a shared output folder", "[coordinator]") {
  TempDb db;
  CoordinatorOptions o = Options();
  o.validator = [](const JobSpec& s) {
    std::vector<std::string> p;
    if (s.train.steps <= 0) p.push_back("steps");
    if (s.name.empty()) p.push_back("name");
    return p;
  };
  Coordinator c(o, Journal(db.path()), 0);
  SubmitRequest bad = Job("", 0);
  bad.spec.train.steps = 0;
  SubmitReply r = c.Submit(bad);
  CHECK(r.job_id == 0);
  CHECK(r.problems == std::vector<std::string>{"steps", "name"});
  REQUIRE(c.Submit(Job("a", 0)).job_id == 1);
  SubmitReply dup = c.Submit(Job("a", 0));
  CHECK(dup.job_id == 0);
  REQUIRE(dup.problems.size() == 1);
  CHECK_THAT(dup.problems[0], Catch::Contains("already used by job 1"));
}

TEST_CASE("the ETA follows a moving average of the step time, the start-up step replaced",
          "[coordinator]") {
  TempDb db;
  Coordinator c(Options(), Journal(db.path()), 0);
  int64_t id = c.Submit(Job("ema", 0)).job_id;
  std::string w = c.Register(Worker("a", {{"tiny", ""}}), 0).worker_id;
  REQUIRE(c.Heartbeat(HeartbeatRequest{w, {}, 1}, 0).assignment.job_id == id);
  auto report = [&](int64_t step, double step_seconds) {
    StepReport r{w, id, 1, {}};
    r.stats.step = step;
    r.stats.total_steps = 100;
    r.stats.step_seconds = step_seconds;
    r.stats.tokens_per_second = 1000 / step_seconds;
    c.Step(r, 1);
    return c.ShowJob(ShowJobRequest{id}, 1).job;
  };
  CHECK(report(1, 10.0).eta_seconds == Approx(99 * 10.0));  // the start-up step, alone
  CHECK(report(2, 1.0).eta_seconds == Approx(98 * 1.0));    // replaces it outright
  // A jumpy step moves the average by a fifth; the raw figure stays in the job's statistics.
  const JobSummary j = report(3, 0.1);
  CHECK(j.eta_seconds == Approx(97 * (0.8 * 1.0 + 0.2 * 0.1)));
  CHECK(j.last_stats.step_seconds == Approx(0.1));
  const std::vector<StepStats> rows = c.Stats(StatsRequest{id}).stats;
  REQUIRE_FALSE(rows.empty());
  CHECK(rows.back().step_seconds == Approx(0.1));
}
