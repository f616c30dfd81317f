// Trust model on the coordinator's side (docs/TRUST.md): one coordinator per journal,
// an owner-only journal, output folders compared by canonical path, each job's submitter
// recorded (from the kernel on an ipc socket), TCP without CURVE only with --insecure.
#include <catch2/catch.hpp>

#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "common/posix/remove_tree.h"
#include "common/posix/subprocess.h"
#include "common/posix/user_access.h"
#include "coordinator/client/client.h"
#include "coordinator/client/curve.h"
#include "coordinator/daemon/coordinator.h"
#include "coordinator/daemon/coordinator_server.h"
#include "coordinator/daemon/tensorboard.h"
#include "tests/support/test_support.h"
#include "tests/temp_user.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::coordinator;
namespace fs = std::filesystem;

namespace {

CoordinatorOptions Options() {
  CoordinatorOptions o;
  o.validator = [](const JobSpec&) { return std::vector<std::string>{}; };
  return o;
}

SubmitRequest Job(const std::string& name, const std::string& output_dir) {
  SubmitRequest r;
  r.spec.name = name;
  r.spec.model.store = "tiny";
  r.spec.train.steps = 10;
  r.spec.train.output_dir = output_dir;
  r.spec.source = name + ".toml";
  return r;
}

struct TempDir {
  std::string path = CanonicalPath(
      (fs::temp_directory_path() / ("lorastream-trust-" + std::to_string(getpid()))).string());
  TempDir() {
    RemoveTree(path);
    fs::create_directories(path);
  }
  ~TempDir() { RemoveTree(path); }
};

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_mode & 0777;
}

}  // namespace

TEST_CASE("a second coordinator on one journal is refused naming the pid; no job is lost",
          "[coordinator]") {
  TempDir dir;
  const std::string db = dir.path + "/j.db";
  std::vector<int64_t> ids;
  {
    Coordinator first(Options(), Journal(db), 0);
    for (int i = 0; i < 3; ++i)
      ids.push_back(
          first.Submit(Job("a" + std::to_string(i), dir.path + "/o" + std::to_string(i))).job_id);
    try {
      Coordinator second(Options(), Journal(db), 0);
      FAIL("a second coordinator opened the journal");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kRefused);
      CHECK_THAT(e.what(), Catch::Contains("journal " + db + " is in use by coordinator pid " +
                                           std::to_string(getpid())));
    }
    // The first goes on acknowledging jobs, with ids of its own.
    ids.push_back(first.Submit(Job("late", dir.path + "/late")).job_id);
  }
  CHECK(ids == std::vector<int64_t>{1, 2, 3, 4});
  Coordinator after(Options(), Journal(db), 0);
  CHECK(after.ListJobs(ListJobsRequest{true}, 0).jobs.size() == 4);
}

TEST_CASE("the journal and its files are owner-only, older readable ones are tightened",
          "[coordinator]") {
  TempDir dir;
  const std::string db = dir.path + "/j.db";
  ::umask(022);
  {
    Coordinator c(Options(), Journal(db), 0);
    c.Submit(Job("x", dir.path + "/out"));
    for (const std::string& f : {db, db + "-wal", db + "-shm", db + ".lock"}) {
      INFO(f);
      CHECK(ModeOf(f) == 0600);
    }
  }
  REQUIRE(::chmod(db.c_str(), 0644) == 0);  // as an older version left it
  Journal again(db);
  CHECK(ModeOf(db) == 0600);
}

TEST_CASE("submit refuses a second live job into one folder however it is spelled",
          "[coordinator]") {
  TempDir dir;
  const std::string dd = dir.path + "/x/dd";
  fs::create_directories(dd);
  fs::create_directory_symlink(dd, dir.path + "/link");
  Coordinator c(Options(), Journal(":memory:"), 0);
  const int64_t first = c.Submit(Job("first", dd)).job_id;
  REQUIRE(first == 1);
  for (const std::string& spelling :
       {dd + "/", dir.path + "/x/./dd", dir.path + "/link", dir.path + "/x/none/../dd"}) {
    INFO(spelling);
    SubmitReply r = c.Submit(Job("again", spelling));
    CHECK(r.job_id == 0);
    REQUIRE(r.problems.size() == 1);
    CHECK_THAT(r.problems[0], Catch::Contains("already used by job 1") && Catch::Contains(dd));
  }
  // A folder that does not exist yet is compared by its canonical prefix too.
  REQUIRE(c.Submit(Job("new", dir.path + "/link/new")).job_id == 2);
  CHECK(c.Submit(Job("new2", dd + "/new/")).job_id == 0);
  // Once the first job ended, its folder is free again.
  CHECK(c.Cancel(CancelRequest{first}).state == JobState::kCancelled);
  CHECK(c.Submit(Job("after", dir.path + "/link/")).job_id == 3);
}

TEST_CASE("a job records its submitter; show, the assignment and the journal carry it",
          "[coordinator]") {
  TempDir dir;
  const std::string db = dir.path + "/j.db";
  const Submitter me = CurrentSubmitter();
  REQUIRE(me.uid == static_cast<int64_t>(::geteuid()));
  {
    Coordinator c(Options(), Journal(db), 0);
    CHECK(c.Submit(Job("bob's", dir.path + "/b"), "", Submitter{4242, "bob"}).job_id == 1);
    CHECK(c.Submit(Job("unknown", dir.path + "/u")).job_id == 2);  // -> the operator
    JobSummary bob = c.ShowJob(ShowJobRequest{1}, 0).job;
    CHECK(bob.submitter_uid == 4242);
    CHECK(bob.submitter == "bob");
    CHECK(c.ShowJob(ShowJobRequest{2}, 0).job.submitter_uid == me.uid);
    RegisterRequest w;
    w.host = "h";
    w.device = "cpu";
    w.stores = {{"tiny", ""}};
    std::string id = c.Register(w, 0).worker_id;
    JobAssignment a = c.Heartbeat(HeartbeatRequest{id, {}, 1}, 0).assignment;
    CHECK(a.job_id == 1);
    CHECK(a.submitter_uid == 4242);
    CHECK(a.submitter == "bob");
  }
  {
    Coordinator c(Options(), Journal(db), 0);
    CHECK(c.ShowJob(ShowJobRequest{1}, 0).job.submitter == "bob");
  }
  // A journal from before submitters (tests/fixtures' version-0 journal less those columns):
  // the columns are added, its jobs go to the operator.
  const std::string old_db = dir.path + "/old.db";
  std::filesystem::copy_file(
      std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/journal-19d7a07/journal.db", old_db);
  sqlite3* raw = nullptr;
  REQUIRE(sqlite3_open(old_db.c_str(), &raw) == SQLITE_OK);
  REQUIRE(sqlite3_exec(raw,
                       "ALTER TABLE jobs DROP COLUMN submitter; "
                       "ALTER TABLE jobs DROP COLUMN submitter_uid;",
                       nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(raw);
  Coordinator c(Options(), Journal(old_db), 0);
  JobSummary old = c.ShowJob(ShowJobRequest{1}, 0).job;
  CHECK(old.submitter_uid == me.uid);
  CHECK(old.submitter == me.name);
}

TEST_CASE("on an ipc socket the submitter is the peer's uid; tcp needs CURVE or --insecure",
          "[coordinator]") {
  TempDir dir;
  ServerOptions o;
  o.db = dir.path + "/j.db";
  o.coordinator = Options();
  o.bind = "tcp://127.0.0.1:0";
  CHECK_THROWS_WITH(CoordinatorServer(o), Catch::Contains("without CURVE lets every user of "
                                                          "this host act as the operator") &&
                                              Catch::Contains("--insecure"));
  o.bind = "ipc://" + dir.path + "/c.sock";
  std::atomic<bool> stop{false};
  auto server = std::make_unique<CoordinatorServer>(o);
  std::thread loop([&] { server->Run(stop); });
  // A second coordinator (another journal) must not steal a live socket.
  ServerOptions o2 = o;
  o2.db = dir.path + "/other.db";
  CHECK_THROWS_WITH(CoordinatorServer(o2), Catch::Contains("another coordinator listens on"));
  {
    Client client(ClientOptions{o.bind, "", 5000});
    SubmitReply r = client.Call(Job("mine", dir.path + "/out"));
    REQUIRE(r.job_id == 1);
    JobSummary j = client.Call(ShowJobRequest{1}).job;
    CHECK(j.submitter_uid == static_cast<int64_t>(::geteuid()));
    CHECK(j.submitter == CurrentSubmitter().name);
  }
  stop = true;
  loop.join();
}

TEST_CASE("the default endpoint is an ipc socket in an owner-only folder", "[coordinator]") {
  TempDir dir;
  const char* saved = std::getenv("XDG_RUNTIME_DIR");
  std::string saved_value = saved ? saved : "";
  ::setenv("XDG_RUNTIME_DIR", dir.path.c_str(), 1);
  CHECK(DefaultRuntimeDir() == dir.path + "/lorastream");
  CHECK(DefaultEndpoint() == "ipc://" + dir.path + "/lorastream/coordinator.sock");
  EnsureOwnerOnlyDir(DefaultRuntimeDir());
  CHECK(ModeOf(DefaultRuntimeDir()) == 0700);
  // A link (or a folder of another user) in its place is refused, not used.
  fs::create_directory_symlink(dir.path, dir.path + "/planted");
  CHECK_THROWS_WITH(EnsureOwnerOnlyDir(dir.path + "/planted"), Catch::Contains("not a folder"));
  if (::geteuid() == 0) {
    fs::create_directories(dir.path + "/theirs");
    REQUIRE(::chown((dir.path + "/theirs").c_str(), 54321, 54321) == 0);
    CHECK_THROWS_WITH(EnsureOwnerOnlyDir(dir.path + "/theirs"), Catch::Contains("uid 54321"));
  }
  ::unsetenv("XDG_RUNTIME_DIR");
  CHECK(DefaultEndpoint() ==
        "ipc:///tmp/lorastream-" + std::to_string(::geteuid()) + "/coordinator.sock");
  if (saved) ::setenv("XDG_RUNTIME_DIR", saved_value.c_str(), 1);
}

TEST_CASE("a default endpoint whose folder another user made first is refused by every client",
          "[coordinator]") {
  testing::TempUser user("ep");
  SKIP_UNLESS_ROOT(user);
  TempDir dir;
  REQUIRE(::chmod(dir.path.c_str(), 0755) == 0);
  // A shared, world-writable runtime folder: the user makes the endpoint's folder first and
  // runs its own coordinator there.
  const std::string runtime = dir.path + "/run";
  fs::create_directories(runtime);
  REQUIRE(::chmod(runtime.c_str(), 01777) == 0);
  SpawnOptions so;
  so.log_path = dir.path + "/user-coordinator.log";
  so.extra_env = {"XDG_RUNTIME_DIR=" + runtime};
  Subprocess theirs = Subprocess::Spawn(
      user.As({testing::Bin("lorastream"), "coordinator", "--db", runtime + "/user.db"}), so);
  REQUIRE(
      testing::WaitFor([&] { return fs::exists(runtime + "/lorastream/coordinator.sock"); }, 60));
  auto run = [&](std::vector<std::string> argv, int* code) {
    argv.insert(argv.begin(), {"env", "XDG_RUNTIME_DIR=" + runtime});
    const std::string err = dir.path + "/err";
    std::string out = RunAndCapture(argv, code, 60, err);
    std::ifstream in(err);
    std::ostringstream text;
    text << in.rdbuf();
    return out + text.str();
  };
  const std::string job = dir.path + "/job.toml";
  std::ofstream(job) << "name = \"j\"\n[model]\nstore = \"tiny\"\n[data]\npath = \"d.jsonl\"\n"
                        "[train]\nsteps = 1\noutput_dir = \"out\"\n";
  std::ofstream(dir.path + "/d.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  int code = -1;
  // Root's client verbs: refused naming the folder's owner, nothing submitted.
  for (const std::vector<std::string>& verb :
       {std::vector<std::string>{"submit", job}, {"jobs"}, {"show", "1"}}) {
    std::vector<std::string> argv = {testing::Bin("lorastream")};
    argv.insert(argv.end(), verb.begin(), verb.end());
    const std::string said = run(argv, &code);
    INFO(verb[0] << ": " << said);
    CHECK(code != 0);
    CHECK_THAT(said, Catch::Contains(runtime + "/lorastream belongs to " + user.name()));
  }
  Client as_user(ClientOptions{"ipc://" + runtime + "/lorastream/coordinator.sock", "", 5000});
  CHECK(as_user.Call(ListJobsRequest{true}).jobs.empty());
  // A worker: refused before it registers.
  const std::string said = run({testing::Bin("lorastream-test-worker"), "--coordinator",
                                "ipc://" + runtime + "/lorastream/coordinator.sock"},
                               &code);
  CHECK(code != 0);
  CHECK_THAT(said, Catch::Contains("belongs to " + user.name()));
  CHECK(as_user.Call(ListWorkersRequest{true}).workers.empty());
  // doctor names it as a problem, with its fix.
  const std::string report = run({testing::Bin("lorastream"), "doctor", "--timeout", "1"}, &code);
  CHECK(code == 1);
  CHECK_THAT(report, Catch::Contains("belongs to " + user.name()) &&
                         Catch::Contains("sudo rm -r " + runtime + "/lorastream"));
  theirs.Stop(30);
}

TEST_CASE("a user sees only its own jobs; the operator sees every job", "[coordinator]") {
  TempDir dir;
  Coordinator c(Options(), Journal(dir.path + "/j.db"), 0);
  Submitter alice{4242, "alice"}, bob{4343, "bob"};
  REQUIRE(c.Submit(Job("a", dir.path + "/a"), "", alice).job_id == 1);
  REQUIRE(c.Submit(Job("b", dir.path + "/b"), "", bob).job_id == 2);
  auto ids = [](const std::vector<JobSummary>& jobs) {
    std::vector<int64_t> out;
    for (const JobSummary& j : jobs) out.push_back(j.id);
    return out;
  };
  CHECK(ids(c.ListJobs(ListJobsRequest{true}, 0, alice).jobs) == std::vector<int64_t>{1});
  CHECK(ids(c.ListJobs(ListJobsRequest{true}, 0, bob).jobs) == std::vector<int64_t>{2});
  CHECK(ids(c.Watch(WatchRequest{}, 0, bob).jobs) == std::vector<int64_t>{2});
  CHECK(c.ShowJob(ShowJobRequest{1}, 0, alice).job.name == "a");
  for (auto refused : std::vector<std::function<void()>>{
           [&] { c.ShowJob(ShowJobRequest{1}, 0, bob); }, [&] { c.Stats(StatsRequest{1}, bob); },
           [&] {
             WatchRequest w;
             w.job_ids = {1};
             c.Watch(w, 0, bob);
           }}) {
    try {
      refused();
      FAIL("bob saw alice's job");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kRefused);
      CHECK_THAT(e.what(), Catch::Contains("job 1 was submitted by another user"));
    }
  }
  // The operator: no user named (a key mapped to none), the coordinator's own user, root.
  for (const Submitter& op : {Submitter{}, CurrentSubmitter(), Submitter{0, "root"}})
    CHECK(ids(c.ListJobs(ListJobsRequest{true}, 0, op).jobs) == std::vector<int64_t>{1, 2});
}

TEST_CASE("over CURVE only a worker's key takes jobs, and a user's key sees only its jobs",
          "[coordinator]") {
  testing::TempUser user("keys");
  SKIP_UNLESS_ROOT(user);
  TempDir dir;
  const std::string keys = dir.path + "/keys", user_keys = dir.path + "/user-keys";
  WriteCurveKeys(keys, false);
  WriteCurveKeys(user_keys, false);
  fs::copy_file(keys + "/coordinator.pub", user_keys + "/coordinator.pub",
                fs::copy_options::overwrite_existing);
  std::ofstream(keys + "/authorized_clients", std::ios::app)
      << LoadClientKeys(user_keys).client.public_key << " " << user.name() << "\n";
  ServerOptions o;
  o.db = dir.path + "/j.db";
  o.coordinator = Options();
  o.bind = "tcp://127.0.0.1:0";
  o.curve_keys_dir = keys;
  std::atomic<bool> stop{false};
  auto server = std::make_unique<CoordinatorServer>(o);
  std::thread loop([&] { server->Run(stop); });
  RegisterRequest reg;
  reg.host = "h";
  reg.device = "cpu";
  {
    Client operator_client(ClientOptions{server->endpoint(), keys, 5000});
    Client user_client(ClientOptions{server->endpoint(), user_keys, 5000});
    ClientOptions as_worker{server->endpoint(), keys, 5000};
    as_worker.key_role = "worker";
    Client worker(as_worker);
    REQUIRE(operator_client.Call(Job("ops", dir.path + "/ops")).job_id == 1);
    REQUIRE(user_client.Call(Job("users", dir.path + "/users")).job_id == 2);
    // A client key, the operator's or a user's, does not register as a worker.
    for (Client* c : {&operator_client, &user_client}) {
      try {
        c->Call(reg);
        FAIL("a client key registered as a worker");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kRefused);
        CHECK_THAT(e.what(), Catch::Contains("this key is not a worker's"));
      }
    }
    CHECK(operator_client.Call(ListWorkersRequest{true}).workers.empty());
    // The worker's key registers, and does nothing a client does.
    CHECK_FALSE(worker.Call(reg).worker_id.empty());
    CHECK_THROWS_WITH(worker.Call(ListJobsRequest{true}),
                      Catch::Contains("a worker's key is for workers only"));
    // The user sees its own job only; the operator sees both.
    std::vector<JobSummary> seen = user_client.Call(ListJobsRequest{true}).jobs;
    REQUIRE(seen.size() == 1);
    CHECK(seen[0].id == 2);
    CHECK_THROWS_WITH(user_client.Call(ShowJobRequest{1}),
                      Catch::Contains("submitted by another user"));
    CHECK_THROWS_WITH(user_client.Call(StatsRequest{1}),
                      Catch::Contains("submitted by another user"));
    CHECK(operator_client.Call(ListJobsRequest{true}).jobs.size() == 2);
  }
  // A keys folder without a worker list (an older keygen's) is refused at start.
  fs::remove(keys + "/authorized_workers");
  ServerOptions again = o;
  again.db = dir.path + "/again.db";
  CHECK_THROWS_WITH(CoordinatorServer(again), Catch::Contains("authorized_workers is missing"));
  stop = true;
  loop.join();
}

TEST_CASE("a TensorBoard run folder is created, never followed through a link placed before",
          "[coordinator]") {
  TempDir dir;
  const std::string logs = dir.path + "/tb", victim = dir.path + "/victim";
  fs::create_directories(logs);
  fs::create_directories(victim);
  REQUIRE(::chmod(logs.c_str(), 01777) == 0);  // shared by every user
  REQUIRE(::chmod(victim.c_str(), 0700) == 0);
  TensorBoardWriter writer(logs);
  JobSummary job;
  job.id = 14;
  job.name = "tbt";
  StepStats step;
  step.step = 1;
  // Planted under the job's run name: a link to a folder of the coordinator's user.
  fs::create_directory_symlink(victim, logs + "/job-14-tbt");
  CHECK_THROWS_WITH(writer.Write(job, step), Catch::Contains(logs + "/job-14-tbt"));
  CHECK(fs::is_empty(victim));
  // Another user's folder under a run's name.
  job.id = 15;
  if (::geteuid() == 0) {
    fs::create_directories(logs + "/job-15-tbt");
    REQUIRE(::chown((logs + "/job-15-tbt").c_str(), 54321, 54321) == 0);
    CHECK_THROWS_WITH(writer.Write(job, step), Catch::Contains("belongs to uid 54321"));
    CHECK(fs::is_empty(logs + "/job-15-tbt"));
  }
  // A run of its own is written.
  job.id = 16;
  writer.Write(job, step);
  CHECK_FALSE(fs::is_empty(logs + "/job-16-tbt"));
}
