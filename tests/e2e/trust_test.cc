// Trust model end to end (docs/TRUST.md), with a temporary unprivileged user: it
// reaches a root coordinator only with a CURVE key mapped to it, its jobs run on a root
// worker only over paths it could open itself (data, eval data, every file of a model
// folder), what they write is created as it and no file of root's changes owner (links
// placed before or during the job included), and the coordinator's owner-only ipc folder
// keeps it out. Then, as root alone: a paused worker's job taken over by its next attempt,
// a job larger than the machine refused, and a stop honoured in the middle of a step.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
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

#include "common/posix/file_lock.h"
#include "common/posix/remove_tree.h"
#include "common/posix/subprocess.h"
#include "coordinator/client/client.h"
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

// `store`: a store's name, or "checkpoint=DIR" for a model folder. `extra`: more TOML after
// the [train] keys (more of them, or further sections).
std::string WriteJob(const std::string& path, const std::string& store, const std::string& data,
                     const std::string& output_dir, const std::string& stats_file = "",
                     const std::string& extra = "") {
  std::ofstream out(path);
  const bool folder = store.rfind("checkpoint=", 0) == 0;
  out << "name = \"" << fs::path(path).stem().string() << "\"\n"
      << "[model]\n"
      << (folder ? "checkpoint = \"" + store.substr(11) : "store = \"" + store) << "\"\n"
      << "[data]\npath = \"" << data << "\"\nseq_len = 32\n"
      << "[lora]\nrank = 4\nalpha = 8.0\n"
      << "[train]\nsteps = 3\nbatch_size = 1\noutput_dir = \"" << output_dir << "\"\n";
  if (!stats_file.empty()) out << "stats_file = \"" << stats_file << "\"\n";
  out << extra;
  return path;
}

// A tiny model written into DIR/model and served as the store `store` (logs in DIR/logs),
// once it can be attached.
Subprocess ServeTinyStore(const std::string& dir, const std::string& store) {
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
  return store_proc;
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
  const std::string job_eval = WriteJob(jobs_dir + "/eval.toml", store, data, home + "/out6", "",
                                        "[eval]\npath = \"" + root_only + "\"\n");
  // A model folder of the user's whose weights file is a link to a file in a root-only folder.
  const std::string job_model =
      WriteJob(jobs_dir + "/model.toml", "checkpoint=" + home + "/model", data, home + "/out7");
  const std::string job_held =
      WriteJob(jobs_dir + "/held.toml", store, data, home + "/out5", "", "checkpoint_every = 1\n");
  for (const auto& entry : fs::recursive_directory_iterator(home)) user.Own(entry.path().string());
  user.Own(home);
  REQUIRE(::chmod(user_keys.c_str(), 0700) == 0);

  // Root's cluster: a store, a CURVE coordinator on loopback TCP, one CPU worker.
  Subprocess store_proc = ServeTinyStore(dir, store);
  SpawnOptions so;
  fs::create_directories(dir + "/root-only");
  REQUIRE(::chmod((dir + "/root-only").c_str(), 0700) == 0);
  fs::copy_file(dir + "/model/model.safetensors", dir + "/root-only/model.safetensors");
  fs::create_directories(home + "/model");
  fs::copy_file(dir + "/model/config.json", home + "/model/config.json");
  fs::create_symlink(dir + "/root-only/model.safetensors", home + "/model/model.safetensors");
  for (const std::string& p : {home + "/model", home + "/model/config.json"}) user.Own(p);
  user.Own(home + "/model/model.safetensors");
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
    const int64_t bad_eval = submit(job_eval);
    const int64_t bad_model = submit(job_model);
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
    j = finished(bad_eval);
    CHECK(j.state == JobState::kFailed);
    CHECK_THAT(j.reason, Catch::Contains("`eval.path` (" + root_only + ")"));
    j = finished(bad_model);
    CHECK(j.state == JobState::kFailed);
    CHECK_THAT(j.reason,
               Catch::Contains("`model.checkpoint` (" + home + "/model/model.safetensors)") &&
                   Catch::Contains("no permission to search " + dir + "/root-only"));
    CHECK_FALSE(fs::exists(home + "/out6"));
    CHECK_FALSE(fs::exists(home + "/out7"));
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
    std::ofstream(home + "/busy/.lorastream.lock").close();  // the user's, as its jobs make it
    user.Own(home + "/busy/.lorastream.lock");
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
    // Root's files the user placed in its output folder before the job: one moved in, one
    // hard link. The job creates its files as the user and changes no owner.
    fs::create_directories(home + "/out4");
    user.Own(home + "/out4");
    const std::string moved = home + "/out4/moved.txt", linked = dir + "/root-file.txt";
    std::ofstream(moved) << "root's";
    std::ofstream(linked) << "root's";
    REQUIRE(::chmod(moved.c_str(), 0644) == 0);
    REQUIRE(::chmod(linked.c_str(), 0644) == 0);
    REQUIRE(::link(linked.c_str(), (home + "/out4/hard").c_str()) == 0);
    JobSummary j = finished(submit(job_ok));
    INFO(j.reason);
    REQUIRE(j.state == JobState::kSucceeded);
    CHECK(j.submitter == user.name());
    CHECK(OwnerOf(moved) == 0u);
    CHECK(OwnerOf(linked) == 0u);
    for (const std::string& f : {home + "/out4", home + "/out4/adapter_model.safetensors",
                                 home + "/out4/stats.jsonl", home + "/out4/.lorastream.lock"}) {
      INFO(f);
      CHECK(OwnerOf(f) == user.uid());
    }
  }
  SECTION("links placed during the job lead nowhere and no file of root's changes owner") {
    // The worker holds after the job's first checkpoint (SIGUSR1) while the user places a
    // link to a root-only file where the statistics go and a hard link to a root file.
    REQUIRE(::kill(worker.pid(), SIGUSR1) == 0);
    const int64_t id = submit(job_held);
    WaitUntil([&] { return client.Call(ShowJobRequest{id}).job.checkpoint_step >= 1; }, 600,
              "the job's first checkpoint");
    const std::string victim = dir + "/root-only/victim.txt", linked = dir + "/root-file2.txt";
    std::ofstream(victim) << "root's secret";
    std::ofstream(linked) << "root's";
    REQUIRE(::chmod(victim.c_str(), 0600) == 0);
    REQUIRE(::chmod(linked.c_str(), 0644) == 0);
    fs::remove(home + "/out5/stats.jsonl");
    fs::create_symlink(victim, home + "/out5/stats.jsonl");
    REQUIRE(::link(linked.c_str(), (home + "/out5/hard").c_str()) == 0);
    REQUIRE(::kill(worker.pid(), SIGUSR2) == 0);
    JobSummary j = finished(id);
    CHECK(j.state == JobState::kFailed);
    CHECK_THAT(j.reason, Catch::Contains("train.stats_file"));
    CHECK(ReadAll(victim) == "root's secret");
    CHECK(OwnerOf(victim) == 0u);
    CHECK(OwnerOf(linked) == 0u);
    CHECK(OwnerOf(home + "/out5/checkpoint-1") == user.uid());
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

namespace {

// As root alone: a tiny model's folder and a store serving it, in a fresh folder.
struct RootCluster {
  std::string dir, store;
  Subprocess store_proc;
  explicit RootCluster(const std::string& tag)
      : dir((fs::temp_directory_path() / ("lorastream-e2e-" + tag + "-" + std::to_string(getpid())))
                .string()),
        store(tag + "-" + std::to_string(getpid())) {
    RemoveTree(dir);
    fs::create_directories(dir + "/logs");
    store_proc = ServeTinyStore(dir, store);
  }
  ~RootCluster() {
    if (store_proc.valid()) store_proc.Stop(30);
    RemoveTree(dir);
  }
  Subprocess Spawn(const std::vector<std::string>& argv, const std::string& log) const {
    SpawnOptions so;
    so.log_path = dir + "/logs/" + log;
    return Subprocess::Spawn(argv, so);
  }
};

// Documents of `tokens` ids each.
void WriteLongData(const std::string& path, int documents, int tokens) {
  std::ofstream out(path);
  std::mt19937 rng(11);
  for (int d = 0; d < documents; ++d) {
    out << "{\"input_ids\": [";
    for (int i = 0; i < tokens; ++i) out << (i ? ", " : "") << rng() % 384;
    out << "]}\n";
  }
}

}  // namespace

TEST_CASE("a paused worker's job is taken over by its next attempt and ends as if uninterrupted",
          "[e2e]") {
  RootCluster c("takeover");
  const std::string data = c.dir + "/data.jsonl";
  WriteData(data);
  const std::string job =
      WriteJob(c.dir + "/job.toml", c.store, data, c.dir + "/out", "", "checkpoint_every = 2\n");
  // The same job, uninterrupted, for the reference adapter.
  const std::string ref =
      WriteJob(c.dir + "/ref.toml", c.store, data, c.dir + "/ref", "", "checkpoint_every = 2\n");
  for (const std::string& f : {job, ref}) {  // 8 steps instead of 3
    std::string text = ReadAll(f);
    text.replace(text.find("steps = 3"), 9, "steps = 8");
    std::ofstream(f) << text;
  }
  int code = -1;
  RunAndCapture({Bin("lorastream-worker"), "train", ref, "--device", "cpu", "--threads", "1"},
                &code, 600, c.dir + "/logs/ref.err");
  REQUIRE(code == 0);

  const std::string endpoint = "ipc://" + c.dir + "/coordinator.sock";
  Subprocess coordinator =
      c.Spawn({Bin("lorastream"), "coordinator", "--bind", endpoint, "--db", c.dir + "/j.db",
               "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"},
              "coordinator.log");
  auto serve = [&](const std::string& log) {
    return c.Spawn({Bin("lorastream-worker"), "serve", "--coordinator", endpoint, "--device", "cpu",
                    "--threads", "1", "--store", c.store},
                   log);
  };
  Client client(ClientOptions{endpoint, "", 5000});
  auto workers = [&] {
    try {
      return client.Call(ListWorkersRequest{false}).workers.size();
    } catch (const Error&) {
      return size_t{0};
    }
  };
  Subprocess a = serve("worker-a.log");
  WaitUntil([&] { return workers() == 1; }, 300, "worker a");
  REQUIRE(::kill(a.pid(), SIGUSR1) == 0);  // hold after its first checkpoint
  const std::string out =
      RunAndCapture({Bin("lorastream"), "--coordinator", endpoint, "submit", job, "-q"}, &code, 60,
                    c.dir + "/logs/submit.err");
  REQUIRE(code == 0);
  const int64_t id = std::stoll(out);
  WaitUntil([&] { return client.Call(ShowJobRequest{id}).job.checkpoint_step >= 2; }, 300,
            "attempt 1's checkpoint");
  Subprocess b = serve("worker-b.log");
  WaitUntil([&] { return workers() == 2; }, 300, "worker b");
  REQUIRE(::kill(b.pid(), SIGUSR1) == 0);
  // Worker a pauses past the heartbeat timeout: the job goes to b as attempt 2, which takes
  // the output folder over from the paused attempt 1 (still holding its lock).
  REQUIRE(::kill(a.pid(), SIGSTOP) == 0);
  REQUIRE(::kill(a.pid(), SIGUSR2) == 0);  // delivered when it resumes
  const std::string job_text = "job " + std::to_string(id) + " attempt ";
  auto wait_log = [&](const std::string& log, const std::string& text, const std::string& what) {
    const std::string path = c.dir + "/logs/" + log;
    WaitUntil([&] { return ReadAll(path).find(text) != std::string::npos; }, 300,
              what + " (log " + path + ")");
  };
  wait_log("worker-b.log", "taking it over from " + job_text + "1", "attempt 2 taking over");
  // Worker a resumes while attempt 2 runs: attempt 1 is fenced, writes nothing and stops.
  REQUIRE(::kill(a.pid(), SIGCONT) == 0);
  wait_log("worker-a.log", "was taken over by " + job_text + "2", "attempt 1 fenced");
  REQUIRE(::kill(b.pid(), SIGUSR2) == 0);
  JobSummary j;
  WaitUntil(
      [&] {
        j = client.Call(ShowJobRequest{id}).job;
        return IsTerminal(j.state);
      },
      300, "the job's end");
  INFO(j.reason);
  CHECK(j.state == JobState::kSucceeded);
  CHECK(j.attempt == 2);
  CHECK(ReadAll(c.dir + "/out/adapter_model.safetensors") ==
        ReadAll(c.dir + "/ref/adapter_model.safetensors"));
  b.Stop(60);
  a.Stop(60);
  coordinator.Stop(30);
}

TEST_CASE("a job larger than the machine is refused at start; a stop ends a step midway", "[e2e]") {
  RootCluster c("limits");
  const std::string data = c.dir + "/data.jsonl";
  WriteLongData(data, 16, 300);
  int code = -1;
  SECTION("an estimated peak beyond the host's memory is refused, naming both") {
    const std::string job =
        WriteJob(c.dir + "/big.toml", c.store, data, c.dir + "/big", "", "batch_size = 4096\n");
    std::string text = ReadAll(job);
    text.replace(text.find("batch_size = 1\n"), 15, "");
    text.replace(text.find("seq_len = 32"), 12, "seq_len = 256");
    std::ofstream(job) << text;
    RunAndCapture({Bin("lorastream-worker"), "train", job, "--device", "cpu", "--threads", "1"},
                  &code, 300, c.dir + "/logs/big.err");
    const std::string err = ReadAll(c.dir + "/logs/big.err");
    INFO(err);
    CHECK(code == 5);
    CHECK_THAT(err, Catch::Contains("estimated peak memory") &&
                        Catch::Contains("of the host's memory (cpu)"));
    CHECK_FALSE(fs::exists(c.dir + "/big/stats.jsonl"));
  }
  SECTION("SIGTERM in the middle of a long step stops it within that step") {
    // Each step: 16 micro-batches, long enough for the signal to land inside step 2.
    const std::string job =
        WriteJob(c.dir + "/long.toml", c.store, data, c.dir + "/long", "", "grad_accum = 16\n");
    std::string text = ReadAll(job);
    text.replace(text.find("seq_len = 32"), 12, "seq_len = 256");
    std::ofstream(job) << text;
    Subprocess train = c.Spawn(
        {Bin("lorastream-worker"), "train", job, "--device", "cpu", "--threads", "1"}, "long.log");
    WaitUntil(
        [&] { return ReadAll(c.dir + "/logs/long.log").find("step 1/3") != std::string::npos; },
        300, "step 1");
    REQUIRE(::kill(train.pid(), SIGTERM) == 0);
    CHECK(train.Wait(120) == 143);
    CHECK_THAT(ReadAll(c.dir + "/logs/long.log"),
               Catch::Contains("stopped by signal 15 at step 1:"));
  }
}
