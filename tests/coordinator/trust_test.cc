// Trust model on the coordinator's side (README: Trust model): one coordinator per journal,
// an owner-only journal, output folders compared by canonical path, each job's submitter
// recorded (from the kernel on an ipc socket), TCP without CURVE only with --insecure.
#include <catch2/catch.hpp>

#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "common/remove_tree.h"
#include "common/user_access.h"
#include "coordinator/client.h"
#include "coordinator/coordinator.h"
#include "coordinator/coordinator_server.h"
#include "coordinator/curve.h"

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
    JobAssignment a = c.Heartbeat(HeartbeatRequest{id, 0, 0}, 0).assignment;
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
