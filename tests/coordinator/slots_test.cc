// The coordinator filling workers' job slots, without sockets: jobs that may share a group fill
// one worker, one that may not goes elsewhere or waits, priority then age, no starvation, a
// dead worker's jobs all requeued from their own checkpoints, re-registration with several
// running jobs, the submitter rule of root workers, and what `workers` shows.
#include <catch2/catch.hpp>

#include <algorithm>

#include "coordinator/cli/cli_format.h"
#include "coordinator/daemon/coordinator.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using namespace lorastream::coordinator;

namespace {

std::vector<std::string> NoProblems(const JobSpec&) { return {}; }

CoordinatorOptions Options() {
  CoordinatorOptions o;
  o.heartbeat_timeout_s = 5;
  o.max_retries = 3;
  o.validator = NoProblems;
  return o;
}

// dtype "auto" is f32 on a CPU worker; "bf16" cannot share its group.
SubmitRequest Job(const std::string& name, int priority = 0, const std::string& dtype = "auto") {
  SubmitRequest r;
  r.spec.name = name;
  r.spec.priority = priority;
  r.spec.model.store = "tiny";
  r.spec.train.steps = 10;
  r.spec.train.dtype = dtype;
  r.spec.train.output_dir = "/tmp/slots-out-" + name;
  r.spec.source = name + ".toml";
  return r;
}

RegisterRequest Worker(const std::string& host, int slots, int64_t uid = 1000) {
  RegisterRequest r;
  r.host = host;
  r.device = "cpu";
  r.stores = {{"tiny", "fp"}};
  r.slots = slots;
  r.uid = uid;
  return r;
}

struct Slots {
  testing::TempDir dir{"slots"};
  std::string db() const { return dir / "j.db"; }
};

// A heartbeat of `worker` naming `running` (attempt 1 each unless given): the job it is
// assigned (0: none).
int64_t Beat(Coordinator& c, const std::string& worker, std::vector<RunningJob> running, double now,
             int32_t free_slots = 1) {
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{worker, std::move(running), free_slots}, now);
  REQUIRE(hb.known_worker);
  return hb.has_assignment ? hb.assignment.job_id : 0;
}

void Succeed(Coordinator& c, const std::string& worker, int64_t job, double now,
             int32_t attempt = 1) {
  c.Finished(JobFinished{worker, job, attempt, JobOutcome::kSucceeded, "", "/a", 10}, now);
}

const WorkerSummary& WorkerOf(const ListWorkersReply& r, const std::string& id) {
  for (const WorkerSummary& w : r.workers)
    if (w.id == id) return w;
  FAIL("no worker " << id);
  return r.workers.front();
}

}  // namespace

TEST_CASE("slots: two jobs that may share a group fill one 2-slot worker; another goes elsewhere",
          "[coordinator][slots]") {
  Slots t;
  Coordinator c(Options(), Journal(t.db()), 0);
  const int64_t a = c.Submit(Job("a")).job_id;
  const int64_t h = c.Submit(Job("h", 0, "bf16")).job_id;
  const int64_t b = c.Submit(Job("b")).job_id;
  const std::string two = c.Register(Worker("two", 2), 0).worker_id;
  const std::string one = c.Register(Worker("one", 1), 0).worker_id;
  CHECK(Beat(c, two, {}, 1) == a);
  // h (bf16) cannot join a's group (f32); the idle worker can take it, so `two` takes b.
  CHECK(Beat(c, two, {{a, 1}}, 1) == b);
  CHECK(Beat(c, two, {{a, 1}, {b, 1}}, 1) == 0);  // full
  CHECK(Beat(c, one, {}, 1) == h);
  const ListWorkersReply workers = c.ListWorkers(ListWorkersRequest{}, 1);
  CHECK(WorkerOf(workers, two).job_ids == std::vector<int64_t>{a, b});
  CHECK(WorkerOf(workers, two).slots == 2);
  CHECK(cli::FormatSlots(WorkerOf(workers, two)) ==
        "2/2 slots: jobs " + std::to_string(a) + ", " + std::to_string(b));
  CHECK(cli::FormatSlots(WorkerOf(workers, one)) == "1/1 slot: job " + std::to_string(h));
  const std::string table = cli::WorkersTable(workers.workers);
  CHECK_THAT(table, Catch::Contains("SLOTS") && Catch::Contains("2/2") &&
                        Catch::Contains(std::to_string(a) + "," + std::to_string(b)));
  CHECK(cli::ToJson(WorkerOf(workers, two))["job_ids"] == nlohmann::json::array({a, b}));
  // A finished job frees its slot; the worker says how many it takes (none while stopping).
  Succeed(c, two, a, 2);
  const int64_t d = c.Submit(Job("d")).job_id;
  CHECK(Beat(c, two, {{b, 1}}, 2, 0) == 0);
  CHECK(Beat(c, two, {{b, 1}}, 2) == d);
  CHECK(c.ListWorkers(ListWorkersRequest{}, 2).workers.size() == 2);
}

TEST_CASE("slots: FLUX.1 jobs on one store fill a worker's group together, never beside LLM jobs",
          "[coordinator][slots][flux]") {
  Slots t;
  Coordinator c(Options(), Journal(t.db()), 0);
  auto flux = [](const std::string& name, const std::string& dtype = "f32") {
    SubmitRequest r;
    r.spec_toml = "name = \"" + name + "\"\n[flux]\nstore = \"tiny\"\ncache_dir = \"/c\"\n" +
                  "output_dir = \"/tmp/slots-out-" + name + "\"\ndtype = \"" + dtype + "\"\n";
    r.spec = ParseJobSpec(r.spec_toml, name + ".toml");
    return r;
  };
  const std::string w = c.Register(Worker("w", 3), 0).worker_id;
  const int64_t a = c.Submit(Job("a")).job_id;
  CHECK(Beat(c, w, {}, 1) == a);
  const int64_t f = c.Submit(flux("f")).job_id;
  const int64_t g = c.Submit(flux("g")).job_id;
  const int64_t h = c.Submit(flux("h", "bf16")).job_id;
  REQUIRE(f != 0);
  REQUIRE(g != 0);
  REQUIRE(h != 0);
  const int64_t b = c.Submit(Job("b")).job_id;
  // f waits for a's group to drain (the jobs behind it wait too); then g joins f's group, while
  // h (another flux.dtype) and the LLM job b wait for that group to drain.
  CHECK(Beat(c, w, {{a, 1}}, 2) == 0);
  Succeed(c, w, a, 3);
  CHECK(Beat(c, w, {}, 4) == f);
  CHECK(Beat(c, w, {{f, 1}}, 5) == g);
  CHECK(Beat(c, w, {{f, 1}, {g, 1}}, 5) == 0);
  Succeed(c, w, f, 6);
  CHECK(Beat(c, w, {{g, 2}}, 7) == 0);
  Succeed(c, w, g, 8);
  CHECK(Beat(c, w, {}, 9) == h);
  CHECK(Beat(c, w, {{h, 1}}, 10) == 0);
  Succeed(c, w, h, 11);
  CHECK(Beat(c, w, {}, 12) == b);
}

TEST_CASE("slots: free slots take jobs by priority, then age", "[coordinator][slots]") {
  Slots t;
  Coordinator c(Options(), Journal(t.db()), 0);
  const int64_t low = c.Submit(Job("low", 0)).job_id;
  const int64_t high1 = c.Submit(Job("high1", 5)).job_id;
  const int64_t mid = c.Submit(Job("mid", 2)).job_id;
  const int64_t high2 = c.Submit(Job("high2", 5)).job_id;
  const std::string w = c.Register(Worker("w", 3), 0).worker_id;
  CHECK(Beat(c, w, {}, 1) == high1);
  CHECK(Beat(c, w, {{high1, 1}}, 1) == high2);
  CHECK(Beat(c, w, {{high1, 1}, {high2, 1}}, 1) == mid);
  Succeed(c, w, high2, 2);
  CHECK(Beat(c, w, {{high1, 1}, {mid, 1}}, 2) == low);
}

TEST_CASE("slots: the head of the queue that fits no group is not starved: a worker drains",
          "[coordinator][slots]") {
  Slots t;
  Coordinator c(Options(), Journal(t.db()), 0);
  const std::string w = c.Register(Worker("w", 2), 0).worker_id;
  const int64_t a = c.Submit(Job("a")).job_id;
  CHECK(Beat(c, w, {}, 1) == a);
  const int64_t h = c.Submit(Job("h", 0, "bf16")).job_id;  // fits no group: w runs f32
  const int64_t b = c.Submit(Job("b")).job_id;             // would join a's group
  // Without draining, b and every f32 job after it would keep w's group busy for ever; w
  // takes none of them while h waits.
  CHECK(Beat(c, w, {{a, 1}}, 2) == 0);
  CHECK(Beat(c, w, {{a, 1}}, 3) == 0);
  CHECK(c.ShowJob(ShowJobRequest{b}, 3).job.state == JobState::kQueued);
  Succeed(c, w, a, 4);
  CHECK(Beat(c, w, {}, 5) == h);
  // Now b is the head, and h's group refuses it in turn: w drains again.
  CHECK(Beat(c, w, {{h, 1}}, 6) == 0);
  Succeed(c, w, h, 7);
  CHECK(Beat(c, w, {}, 8) == b);

  // Two busy workers: only the one with fewer jobs drains; the other keeps filling its slots.
  const std::string v = c.Register(Worker("v", 3), 8).worker_id;
  const int64_t b2 = c.Submit(Job("b2")).job_id;
  const int64_t b3 = c.Submit(Job("b3")).job_id;
  CHECK(Beat(c, v, {}, 9) == b2);
  CHECK(Beat(c, v, {{b2, 1}}, 9) == b3);
  const int64_t h2 = c.Submit(Job("h2", 0, "bf16")).job_id;
  const int64_t b4 = c.Submit(Job("b4")).job_id;
  CHECK(Beat(c, w, {{b, 1}}, 10) == 0);             // w (1 job) drains for h2
  CHECK(Beat(c, v, {{b2, 1}, {b3, 1}}, 10) == b4);  // v (2 jobs) takes b4
  Succeed(c, w, b, 11);
  CHECK(Beat(c, w, {}, 12) == h2);
}

TEST_CASE("slots: a dead 2-slot worker requeues both jobs, each from its own checkpoint",
          "[coordinator][slots]") {
  Slots t;
  int64_t a = 0, b = 0;
  {
    Coordinator c(Options(), Journal(t.db()), 0);
    a = c.Submit(Job("a")).job_id;
    b = c.Submit(Job("b")).job_id;
    const std::string w = c.Register(Worker("w", 2), 0).worker_id;
    REQUIRE(Beat(c, w, {}, 0) == a);
    REQUIRE(Beat(c, w, {{a, 1}}, 0) == b);
    c.Checkpoint(CheckpointReport{w, a, 1, 4, "/out-a/checkpoint-4"}, 1);
    c.Checkpoint(CheckpointReport{w, b, 1, 6, "/out-b/checkpoint-6"}, 1);
    c.Tick(10);  // silent for 9 s > 5 s: dead
    for (int64_t id : {a, b}) {
      const JobSummary s = c.ShowJob(ShowJobRequest{id}, 10).job;
      CHECK(s.state == JobState::kQueued);
      CHECK_THAT(s.reason, Catch::Contains("died"));
    }
    CHECK(c.ListWorkers(ListWorkersRequest{}, 10).workers.at(0).job_ids.empty());
  }
  // The journal has both requeued, with their checkpoints (a restart loses neither).
  Coordinator c(Options(), Journal(t.db()), 20);
  const std::string v = c.Register(Worker("v", 2), 20).worker_id;
  HeartbeatReply first = c.Heartbeat(HeartbeatRequest{v, {}, 2}, 20);
  REQUIRE(first.assignment.job_id == a);
  CHECK(first.assignment.attempt == 2);
  CHECK(first.assignment.resume_step == 4);
  CHECK(first.assignment.checkpoint_path == "/out-a/checkpoint-4");
  HeartbeatReply second = c.Heartbeat(HeartbeatRequest{v, {{a, 2}}, 1}, 20);
  REQUIRE(second.assignment.job_id == b);
  CHECK(second.assignment.resume_step == 6);
}

TEST_CASE("slots: a worker re-registering after a restart keeps the running jobs it names",
          "[coordinator][slots]") {
  Slots t;
  int64_t a = 0, b = 0, c1 = 0, d = 0;
  std::string w, v;
  {
    Coordinator c(Options(), Journal(t.db()), 0);
    a = c.Submit(Job("a")).job_id;
    b = c.Submit(Job("b")).job_id;
    c1 = c.Submit(Job("c")).job_id;
    d = c.Submit(Job("d")).job_id;
    w = c.Register(Worker("w", 2), 0).worker_id;
    v = c.Register(Worker("v", 2), 0).worker_id;
    REQUIRE(Beat(c, w, {}, 0) == a);
    REQUIRE(Beat(c, w, {{a, 1}}, 0) == b);
    REQUIRE(Beat(c, v, {}, 0) == c1);
    REQUIRE(Beat(c, v, {{c1, 1}}, 0) == d);
  }
  Coordinator c(Options(), Journal(t.db()), 100);
  CHECK_FALSE(c.Heartbeat(HeartbeatRequest{w, {{a, 1}, {b, 1}}, 0}, 100).known_worker);
  RegisterRequest again = Worker("w", 2);
  again.previous_worker_id = w;
  again.running = {{a, 1}, {b, 1}, {c1, 1}};  // c is v's: not honoured
  RegisterReply rr = c.Register(again, 101);
  CHECK(rr.worker_id == w);
  CHECK(rr.kept_jobs == std::vector<int64_t>{a, b});
  // v comes back having lost d (its process restarted, say): d runs elsewhere at once.
  RegisterRequest partial = Worker("v", 2);
  partial.previous_worker_id = v;
  partial.running = {{c1, 1}};
  CHECK(c.Register(partial, 101).kept_jobs == std::vector<int64_t>{c1});
  JobSummary lost = c.ShowJob(ShowJobRequest{d}, 101).job;
  CHECK(lost.state == JobState::kQueued);
  CHECK_THAT(lost.reason, Catch::Contains("re-registered without it"));
  // Nothing to stop for the kept ones; both workers are full again after one assignment.
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{w, {{a, 1}, {b, 1}}, 0}, 102);
  CHECK(hb.stop_jobs.empty());
  CHECK(Beat(c, v, {{c1, 1}}, 102) == d);
  c.Tick(106);  // past the reconcile deadline: every running job has its worker, none requeued
  for (int64_t id : {a, b, c1})
    CHECK(c.ShowJob(ShowJobRequest{id}, 106).job.state == JobState::kRunning);
}

TEST_CASE("slots: a lost assignment reply is sent again; a job not the worker's is stopped",
          "[coordinator][slots]") {
  Slots t;
  Coordinator c(Options(), Journal(t.db()), 0);
  const int64_t a = c.Submit(Job("a")).job_id;
  const int64_t b = c.Submit(Job("b")).job_id;
  const std::string w = c.Register(Worker("w", 2), 0).worker_id;
  REQUIRE(Beat(c, w, {}, 0) == a);
  REQUIRE(Beat(c, w, {{a, 1}}, 0) == b);
  // The reply carrying b was lost: the worker names a only, and gets b again.
  HeartbeatReply again = c.Heartbeat(HeartbeatRequest{w, {{a, 1}}, 1}, 1);
  REQUIRE(again.has_assignment);
  CHECK(again.assignment.job_id == b);
  CHECK(again.assignment.attempt == 1);
  // A cancelled job and one it does not run are named in stop_jobs; the other trains on.
  c.Cancel(CancelRequest{a});
  HeartbeatReply hb = c.Heartbeat(HeartbeatRequest{w, {{a, 1}, {b, 1}, {99, 1}}, 0}, 2);
  CHECK(hb.stop_jobs == std::vector<int64_t>{a, 99});
}

TEST_CASE("slots: a root worker's group is one submitter's; another user's worker mixes them",
          "[coordinator][slots]") {
  Slots t;
  Coordinator c(Options(), Journal(t.db()), 0);
  const Submitter alice{1001, "alice"}, bob{1002, "bob"};
  const int64_t a1 = c.Submit(Job("a1"), "", alice).job_id;
  const int64_t b1 = c.Submit(Job("b1"), "", bob).job_id;
  const int64_t a2 = c.Submit(Job("a2"), "", alice).job_id;
  const std::string root = c.Register(Worker("root", 2, 0), 0).worker_id;
  const std::string plain = c.Register(Worker("plain", 2, 1000), 0).worker_id;
  CHECK(Beat(c, root, {}, 1) == a1);
  // b1 cannot join alice's group on the root worker; the other worker can take it.
  CHECK(Beat(c, root, {{a1, 1}}, 1) == a2);
  CHECK(Beat(c, plain, {}, 1) == b1);
  const int64_t a3 = c.Submit(Job("a3"), "", alice).job_id;
  CHECK(Beat(c, plain, {{b1, 1}}, 2) == a3);  // a worker that acts as nobody mixes submitters
}

TEST_CASE("slots: a worker registers with at least one slot", "[coordinator][slots]") {
  Slots t;
  Coordinator c(Options(), Journal(t.db()), 0);
  CHECK_THROWS_WITH(c.Register(Worker("w", 0), 0), Catch::Contains("at least one job slot"));
}
