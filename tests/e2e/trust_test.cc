// Trust model end to end (README: Trust model), with a temporary unprivileged user: it
// reaches a root coordinator only with a CURVE key mapped to it, its jobs run on a root
// worker only over paths it could open itself, what they write belongs to it, and the
// coordinator's owner-only ipc folder keeps it out.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>

#include "common/file_lock.h"
#include "common/remove_tree.h"
#include "common/subprocess.h"
#include "coordinator/client.h"
#include "store/attach.h"
#include "tests/coordinator/cluster_fixture.h"
#include "tests/e2e/e2e_jobs.h"
#include "tests/temp_user.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::store;
using lorastream::testing::Bin;
using lorastream::testing::FreeLoopbackPort;
using lorastream::testing::ReadAll;
using lorastream::testing::TempUser;
using lorastream::testing::WaitUntil;
namespace fs = std::filesystem;

namespace {

void WriteData(const std::string& path) {
  std::ofstream out(path);
  std::mt19937 rng(7);
  for (int d = 0; d < 16; ++d) {
    out << "{\"input_ids\": [";
    for (int i = 0; i < 40; ++i) out << (i ? ", " : "") << rng() % 512;
    out << "]}\n";
  }
}

std::string WriteJob(const std::string& path, const std::string& store, const std::string& data,
                     const std::string& output_dir, const std::string& stats_file = "") {
  std::ofstream out(path);
  out << "name = \"" << fs::path(path).stem().string() << "\"\n"
      << "[model]\nstore = \"" << store << "\"\n"
      << "[data]\npath = \"" << data << "\"\nseq_len = 32\n"
      << "[lora]\nrank = 4\nalpha = 8.0\n"
      << "[train]\nsteps = 3\nbatch_size = 1\noutput_dir = \"" << output_dir << "\"\n";
  if (!stats_file.empty()) out << "stats_file = \"" << stats_file << "\"\n";
  return path;
}

uid_t OwnerOf(const std::string& path) {
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return st.st_uid;
}

}  // namespace

TEST_CASE("another local user's jobs open only its own paths and their files are its own",
          "[e2e]") {
  TempUser user("e2e");
  SKIP_UNLESS_ROOT(user);
  const std::string dir =
      (fs::temp_directory_path() / ("lorastream-e2e-trust-" + std::to_string(getpid()))).string();
  RemoveTree(dir);
  fs::create_directories(dir + "/logs");
  REQUIRE(::chmod(dir.c_str(), 0755) == 0);
  struct Cleanup {
    std::string dir;
    ~Cleanup() { RemoveTree(dir); }
  } cleanup{dir};
  const std::string tag = std::to_string(getpid());
  const std::string root_secret_dir = "/root/lorastream-trust-" + tag;  // /root is 0700
  const std::string etc_stats = "/etc/lorastream-trust-" + tag + ".jsonl";

  // The user's own folder, files and CURVE key pair; root's keys for the coordinator.
  const std::string home = dir + "/user";
  fs::create_directories(home);
  const std::string keys = dir + "/keys", user_keys = home + "/keys";
  int code = -1;
  RunAndCapture({Bin("lorastream"), "keygen", "--out", keys}, &code, 60, dir + "/logs/keygen");
  REQUIRE(code == 0);
  RunAndCapture({Bin("lorastream"), "keygen", "--out", user_keys}, &code, 60, dir + "/logs/keygen");
  REQUIRE(code == 0);
  fs::copy_file(keys + "/coordinator.pub", user_keys + "/coordinator.pub",
                fs::copy_options::overwrite_existing);
  std::ofstream(keys + "/authorized_clients", std::ios::app)
      << ReadAll(user_keys + "/client.pub").substr(0, 40) << " " << user.name() << "\n";
  const std::string data = home + "/data.jsonl";
  WriteData(data);
  const std::string root_only = dir + "/root-only.jsonl";
  WriteData(root_only);
  REQUIRE(::chmod(root_only.c_str(), 0600) == 0);
  const std::string store = "trust-" + tag;
  const std::string jobs_dir = home + "/jobs";
  fs::create_directories(jobs_dir);
  const std::string job_data = WriteJob(jobs_dir + "/data.toml", store, root_only, home + "/out1");
  const std::string job_out =
      WriteJob(jobs_dir + "/out.toml", store, data, root_secret_dir + "/out");
  const std::string job_stats =
      WriteJob(jobs_dir + "/stats.toml", store, data, home + "/out3", etc_stats);
  const std::string job_ok = WriteJob(jobs_dir + "/ok.toml", store, data, home + "/out4");
  const std::string job_busy = WriteJob(jobs_dir + "/busy.toml", store, data, home + "/busy");
  for (const auto& entry : fs::recursive_directory_iterator(home)) user.Own(entry.path().string());
  user.Own(home);
  REQUIRE(::chmod(user_keys.c_str(), 0700) == 0);

  // Root's cluster: a store, a CURVE coordinator on loopback TCP, one CPU worker.
  SpawnOptions so;
  so.log_path = dir + "/logs/synth.log";
  REQUIRE(
      Subprocess::Spawn({Bin("lorastream-synth"), "--preset", "tiny", "--out", dir + "/model"}, so)
          .Wait(300) == 0);
  so.log_path = dir + "/logs/store.log";
  Subprocess store_proc = Subprocess::Spawn(
      {Bin("lorastream-store"), "serve", dir + "/model", "--name", store, "--no-lock"}, so);
  WaitUntil(
      [&] {
        try {
          AttachedStore::Attach(store);
          return true;
        } catch (const Error&) {
          REQUIRE(store_proc.Running());
          return false;
        }
      },
      300, "the store");
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(FreeLoopbackPort());
  so.log_path = dir + "/logs/coordinator.log";
  Subprocess coordinator =
      Subprocess::Spawn({Bin("lorastream"), "--curve-keys", keys, "coordinator", "--bind", endpoint,
                         "--db", dir + "/journal.db"},
                        so);
  so.log_path = dir + "/logs/worker.log";
  Subprocess worker = Subprocess::Spawn(
      {Bin("lorastream-worker"), "serve", "--coordinator", endpoint, "--curve-keys", keys,
       "--device", "cpu", "--threads", "1", "--store", store},
      so);
  Client client(ClientOptions{endpoint, keys, 5000});
  WaitUntil(
      [&] {
        try {
          return !client.Call(ListWorkersRequest{}).workers.empty();
        } catch (const Error&) {
          return false;
        }
      },
      300, "the worker (log " + dir + "/logs/worker.log)");

  auto submit = [&](const std::string& job) {
    const std::string err = dir + "/logs/submit.err";
    std::string out = RunAndCapture(user.As({Bin("lorastream"), "--coordinator", endpoint,
                                             "--curve-keys", user_keys, "submit", job, "-q"}),
                                    &code, 60, err);
    INFO(ReadAll(err));
    REQUIRE(code == 0);
    return std::stoll(out);
  };
  auto finished = [&](int64_t id) {
    JobSummary j;
    WaitUntil(
        [&] {
          j = client.Call(ShowJobRequest{id}).job;
          return IsTerminal(j.state);
        },
        600, "job " + std::to_string(id) + " (worker log " + dir + "/logs/worker.log)");
    return j;
  };

  SECTION("paths the user could not open are refused, and nothing appears there") {
    const int64_t bad_data = submit(job_data);
    const int64_t bad_out = submit(job_out);
    const int64_t bad_stats = submit(job_stats);
    JobSummary j = finished(bad_data);
    CHECK(j.state == JobState::kFailed);
    CHECK(j.submitter == user.name());
    CHECK(j.submitter_uid == static_cast<int64_t>(user.uid()));
    CHECK_THAT(j.reason,
               Catch::Contains("`data.path` (" + root_only + ")") && Catch::Contains(user.name()));
    j = finished(bad_out);
    CHECK(j.state == JobState::kFailed);
    CHECK_THAT(j.reason, Catch::Contains("`train.output_dir`") &&
                             Catch::Contains("no permission to search /root") &&
                             Catch::Contains(user.name()));
    j = finished(bad_stats);
    CHECK(j.state == JobState::kFailed);
    CHECK_THAT(j.reason, Catch::Contains("`train.stats_file` (" + etc_stats + ")") &&
                             Catch::Contains("/etc"));
    CHECK_FALSE(fs::exists(home + "/out1"));
    CHECK_FALSE(fs::exists(root_secret_dir));
    CHECK_FALSE(fs::exists(home + "/out3"));
    CHECK_FALSE(fs::exists(etc_stats));
  }
  SECTION("the user's own job trains, and what it wrote belongs to the user") {
    // A folder another job trains into (its lock held) is refused at run time, by the served
    // worker and by a standalone `lorastream-worker train`, naming the holder.
    fs::create_directories(home + "/busy");
    user.Own(home + "/busy");
    {
      FileLock held = FileLock::Acquire(home + "/busy/.lorastream.lock",
                                        "job 99 attempt 1 (a test)", "train.output_dir");
      JobSummary busy = finished(submit(job_busy));
      CHECK(busy.state == JobState::kFailed);
      CHECK_THAT(busy.reason, Catch::Contains("is in use by job 99 attempt 1 (a test)"));
      const std::string err = dir + "/logs/standalone.err";
      RunAndCapture({Bin("lorastream-worker"), "train", job_busy, "--device", "cpu"}, &code, 300,
                    err);
      CHECK(code == 5);
      CHECK_THAT(ReadAll(err), Catch::Contains("is in use by job 99 attempt 1 (a test)"));
      CHECK_FALSE(fs::exists(home + "/busy/adapter_model.safetensors"));
    }
    JobSummary j = finished(submit(job_ok));
    INFO(j.reason);
    REQUIRE(j.state == JobState::kSucceeded);
    CHECK(j.submitter == user.name());
    for (const std::string& f : {home + "/out4", home + "/out4/adapter_model.safetensors",
                                 home + "/out4/stats.jsonl", home + "/out4/.lorastream.lock"}) {
      INFO(f);
      CHECK(OwnerOf(f) == user.uid());
    }
  }
  SECTION("a user that cannot reach the coordinator's socket folder is refused") {
    // A coordinator on the default kind of endpoint: an ipc socket in an owner-only folder.
    const std::string runtime = dir + "/runtime";
    so.log_path = dir + "/logs/ipc-coordinator.log";
    so.extra_env = {"XDG_RUNTIME_DIR=" + runtime};
    fs::create_directories(runtime);
    Subprocess ipc =
        Subprocess::Spawn({Bin("lorastream"), "coordinator", "--db", dir + "/ipc.db"}, so);
    const std::string ipc_endpoint = "ipc://" + runtime + "/lorastream/coordinator.sock";
    WaitUntil([&] { return fs::exists(runtime + "/lorastream/coordinator.sock"); }, 60,
              "the ipc coordinator");
    struct stat st {};
    REQUIRE(::stat((runtime + "/lorastream").c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
    RunAndCapture({Bin("lorastream"), "--coordinator", ipc_endpoint, "jobs"}, &code, 60,
                  "/dev/null");
    CHECK(code == 0);  // its own user gets in
    const std::string err = dir + "/logs/refused.err";
    RunAndCapture(user.As({Bin("lorastream"), "--coordinator", ipc_endpoint, "--timeout", "3",
                           "submit", job_ok}),
                  &code, 60, err);
    CHECK(code == 5);  // refused
    CHECK_THAT(ReadAll(err), Catch::Contains("permission denied"));
    Client own(ClientOptions{ipc_endpoint, "", 5000});
    CHECK(own.Call(ListJobsRequest{true}).jobs.empty());
    ipc.Stop(30);
  }
  worker.Stop(60);
  coordinator.Stop(30);
  store_proc.Stop(30);
}
