// End-to-end tests: a real store, coordinator and CPU workers (separate processes, real
// sockets, the tiny model), driven like a user drives them, with parts killed mid-run.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <thread>

#include <catch2/catch.hpp>

#include "common/formats/safetensors.h"
#include "common/posix/shm_names.h"
#include "common/posix/subprocess.h"
#include "coordinator/cli/local_cluster.h"
#include "store/attach.h"
#include "store/manifest_object.h"
#include "tests/e2e/e2e_jobs.h"
#include "tests/support/test_support.h"

using lorastream::cli::LocalCluster;
using lorastream::cli::LocalClusterOptions;
using lorastream::testing::RequireSameAdapter;
using lorastream::testing::TrainStandalone;
using lorastream::testing::WaitUntil;
using lorastream::testing::WriteData;
using lorastream::testing::WriteJob;
namespace fs = std::filesystem;

namespace {

LocalClusterOptions Options(const std::string& run_dir, int workers) {
  LocalClusterOptions o;
  o.bin_dir = LORASTREAM_BIN_DIR;
  o.run_dir = run_dir;
  o.preset = "tiny";
  o.devices.assign(workers, "cpu");
  o.heartbeat_timeout_s = 3;
  o.store_name = "e2e-" + std::to_string(getpid()) + "-" + fs::path(run_dir).filename().string();
  return o;
}

// Lines written so far into the stats.jsonl of every job (one per step trained).
size_t StepsWritten(const nlohmann::json& jobs) {
  size_t lines = 0;
  for (const auto& job : jobs) {
    std::ifstream in(job.value("output_dir", "") + "/stats.jsonl");
    lines += static_cast<size_t>(
        std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n'));
  }
  return lines;
}

}  // namespace

TEST_CASE("three jobs on two workers succeed and equal their standalone runs", "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-three");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(Options(dir, 2));
  cluster.Start();
  // The two CPU workers share the cores rather than each taking all of them.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  for (size_t w = 0; w < cluster.num_workers(); ++w) {
    std::ifstream in("/proc/" + std::to_string(cluster.WorkerPid(w)) + "/cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    CHECK_THAT(cmdline,
               Catch::Contains("--threads " + std::to_string(std::max(1u, cores / 2)) + " "));
  }
  std::vector<int64_t> ids;
  for (int j = 0; j < 3; ++j) {
    std::string data = WriteData(dir, 40, 100 + j);
    ids.push_back(cluster.Submit(
        WriteJob(dir, "job" + std::to_string(j), cluster.store_name(), data, 6, 3, j)));
  }
  nlohmann::json jobs = cluster.WaitForJobs(900);
  REQUIRE(jobs.size() == 3);
  for (const auto& job : jobs) {
    INFO(job.dump());
    CHECK(job["state"] == "succeeded");
  }
  // The same job files, trained standalone against the same store, give the same adapters.
  for (int j = 0; j < 3; ++j) {
    std::string name = "job" + std::to_string(j);
    std::string alone = dir + "/standalone-" + name;
    std::string data = dir + "/data-" + std::to_string(100 + j) + ".jsonl";
    TrainStandalone(WriteJob(dir, name + "-alone", cluster.store_name(), data, 6, 3, j, alone),
                    cluster.log_dir() + "/standalone-" + name + ".log");
    RequireSameAdapter(cluster.ShowJob(ids[j])["output_dir"], alone);
  }
}

TEST_CASE("a store of the host that a worker cannot attach is skipped: it serves the others",
          "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-badstore");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(Options(dir, 1));
  cluster.Start();
  // Another store published on this host that this build cannot read (a model type it does
  // not know, as a store of a later version would have): the cluster's manifest under another
  // name, owned by this process.
  lorastream::Manifest m =
      lorastream::store::AttachedStore::Attach(cluster.store_name()).manifest();
  const std::string other = "e2e-" + std::to_string(getpid()) + "-unreadable";
  m.store_name = other;
  m.config.model_type = "gemma9";
  lorastream::store::ManifestClaim claim = lorastream::store::ManifestClaim::Claim(other, 0644);
  claim.Publish(m);
  cluster.StopWorker(0, SIGTERM);
  cluster.StartWorker(0);  // discovers both stores
  const int64_t id = cluster.Submit(
      WriteJob(dir, "beside", cluster.store_name(), WriteData(dir, 40, 200), 4, 2, 1));
  nlohmann::json jobs = cluster.WaitForJobs(300);
  const std::string log = lorastream::testing::ReadAll(cluster.log_dir() + "/worker-0.log");
  INFO(log);
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["id"] == id);
  CHECK(jobs[0]["state"] == "succeeded");
  CHECK_THAT(log,
             Catch::Contains("not offering store '" + other + "'") && Catch::Contains("gemma9"));
}

TEST_CASE(
    "a worker with two job slots trains two jobs as one group, each equal to its standalone run",
    "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-slots");
  const std::string& dir = run_dir.str();
  LocalClusterOptions options = Options(dir, 1);
  options.jobs_per_worker = 2;  // as `lorastream up --jobs-per-gpu 2` starts its workers
  LocalCluster cluster(options);
  cluster.Start();
  // Both jobs wait in the queue before the worker registers, so that they start together.
  cluster.StopWorker(0, SIGTERM);
  std::vector<int64_t> ids;
  for (int j = 0; j < 2; ++j) {
    const std::string data = WriteData(dir, 40, 200 + j);
    ids.push_back(cluster.Submit(
        WriteJob(dir, "slot" + std::to_string(j), cluster.store_name(), data, 6, 3, 10 + j)));
  }
  cluster.StartWorker(0);
  nlohmann::json jobs = cluster.WaitForJobs(900);
  REQUIRE(jobs.size() == 2);
  const std::string log = lorastream::testing::ReadAll(cluster.log_dir() + "/worker-0.log");
  INFO(log);
  for (const auto& job : jobs) CHECK(job["state"] == "succeeded");
  CHECK_THAT(log, Catch::Contains("job slots: 2 (--jobs)"));
  CHECK_THAT(log, Catch::Contains("joins the group (2 jobs)"));
  const nlohmann::json workers = nlohmann::json::parse(cluster.Client({"workers", "--json"}));
  REQUIRE(workers.size() >= 1);
  for (const auto& w : workers) CHECK(w["slots"] == 2);
  for (int j = 0; j < 2; ++j) {
    // Statistics per job: its own steps, losses and copies.
    const nlohmann::json stats = nlohmann::json::parse(
        cluster.Client({"stats", std::to_string(ids[j]), "--format", "json"}))["stats"];
    REQUIRE(stats.size() == 6);
    CHECK(stats.back()["step"] == 6);
    // The job trained in the group equals the same job trained alone.
    const std::string name = "slot" + std::to_string(j);
    const std::string alone = dir + "/standalone-" + name;
    const std::string data = dir + "/data-" + std::to_string(200 + j) + ".jsonl";
    TrainStandalone(WriteJob(dir, name + "-alone", cluster.store_name(), data, 6, 3, 10 + j, alone),
                    cluster.log_dir() + "/standalone-" + name + ".log");
    RequireSameAdapter(cluster.ShowJob(ids[j])["output_dir"], alone);
  }
}

TEST_CASE("a worker killed mid-job: the job resumes elsewhere and ends bit-identical", "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-killworker");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(Options(dir, 2));
  cluster.Start();
  // Every worker holds the job it runs right after reporting its first checkpoint (SIGUSR1,
  // `lorastream-worker serve`), so the job is mid-run when killed however fast it trains.
  for (size_t i = 0; i < cluster.num_workers(); ++i)
    REQUIRE(::kill(cluster.WorkerPid(i), SIGUSR1) == 0);
  std::string data = WriteData(dir, 80, 7);
  int64_t id = cluster.Submit(WriteJob(dir, "victim", cluster.store_name(), data, 24, 4, 7));
  WaitUntil([&] { return cluster.ShowJob(id).value("checkpoint_step", 0) >= 4; }, 300,
            "the first checkpoint");
  nlohmann::json job = cluster.ShowJob(id);
  REQUIRE(job["state"] == "running");
  REQUIRE(job.value("checkpoint_step", 0) == 4);  // held there: it cannot have gone further
  REQUIRE(job.value("step", 0) < 24);
  const size_t victim = lorastream::testing::WorkerRunningOnly(cluster, id);
  // The survivor must not hold the resumed job (SIGUSR2 clears the request), then the kill.
  REQUIRE(::kill(cluster.WorkerPid(1 - victim), SIGUSR2) == 0);
  cluster.StopWorker(victim, SIGKILL);
  nlohmann::json jobs = cluster.WaitForJobs(900);
  job = cluster.ShowJob(id);
  INFO(job.dump());
  REQUIRE(job["state"] == "succeeded");
  CHECK(job.value("attempt", 0) >= 2);
  CHECK(cluster.WorkerRunning(1 - victim));

  std::string alone = dir + "/standalone";
  TrainStandalone(WriteJob(dir, "victim-alone", cluster.store_name(), data, 24, 4, 7, alone),
                  cluster.log_dir() + "/standalone.log");
  RequireSameAdapter(job["output_dir"], alone);
}

TEST_CASE("a 2-slot worker killed mid-run: both jobs of its group resume elsewhere, bit-identical",
          "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-killslots");
  const std::string& dir = run_dir.str();
  LocalClusterOptions options = Options(dir, 2);
  options.jobs_per_worker = 2;
  LocalCluster cluster(options);
  cluster.Start();
  // Both jobs go to worker 0: worker 1 waits until they have checkpoints, and worker 0 comes
  // back once both are queued. Once each job has a checkpoint, worker 0 holds its group at the
  // next checkpoint it reports (SIGUSR1), so both are mid-run when it is killed.
  cluster.StopWorker(1, SIGTERM);
  cluster.StopWorker(0, SIGTERM);
  const std::string log0 = cluster.log_dir() + "/worker-0.log";
  constexpr int kSteps = 48, kEvery = 2;
  std::vector<std::string> data;
  std::vector<int64_t> ids;
  for (int j = 0; j < 2; ++j) {
    data.push_back(WriteData(dir, 80, 400 + j));
    ids.push_back(cluster.Submit(WriteJob(dir, "group" + std::to_string(j), cluster.store_name(),
                                          data[j], kSteps, kEvery, 20 + j)));
  }
  cluster.StartWorker(0);
  WaitUntil(
      [&] {
        return cluster.ShowJob(ids[0]).value("checkpoint_step", 0) >= kEvery &&
               cluster.ShowJob(ids[1]).value("checkpoint_step", 0) >= kEvery;
      },
      300, "a checkpoint of each job of the group");
  REQUIRE(::kill(cluster.WorkerPid(0), SIGUSR1) == 0);
  WaitUntil(
      [&] {
        return lorastream::testing::ReadAll(log0).find("holding after checkpoint") !=
               std::string::npos;
      },
      300, "worker 0 holding its group");
  for (int64_t id : ids) {
    const nlohmann::json job = cluster.ShowJob(id);
    INFO(job.dump() << lorastream::testing::ReadAll(log0));
    REQUIRE(job["state"] == "running");
    REQUIRE(job.value("step", 0) < kSteps);
    REQUIRE(job.value("attempt", 0) == 1);
  }
  CHECK_THAT(lorastream::testing::ReadAll(log0), Catch::Contains("joins the group (2 jobs)"));
  cluster.StartWorker(1);  // not held: it trains both jobs to their end
  cluster.StopWorker(0, SIGKILL);
  const nlohmann::json jobs = cluster.WaitForJobs(900);
  for (int j = 0; j < 2; ++j) {
    const nlohmann::json job = cluster.ShowJob(ids[j]);
    INFO(job.dump() << lorastream::testing::ReadAll(cluster.log_dir() + "/worker-1.log"));
    REQUIRE(job["state"] == "succeeded");
    CHECK(job.value("attempt", 0) == 2);
    // Each resumed from its own checkpoint and ends as its uninterrupted standalone run.
    const std::string name = "group" + std::to_string(j);
    CHECK_THAT(lorastream::testing::ReadAll(cluster.log_dir() + "/worker-1.log"),
               Catch::Contains("job " + name + ": resuming from " +
                               job["output_dir"].get<std::string>() + "/checkpoint-"));
    const std::string alone = dir + "/standalone-" + name;
    TrainStandalone(WriteJob(dir, name + "-alone", cluster.store_name(), data[j], kSteps, kEvery,
                             20 + j, alone),
                    cluster.log_dir() + "/standalone-" + name + ".log");
    RequireSameAdapter(job["output_dir"], alone);
  }
}

TEST_CASE("the store killed: running jobs finish, a new store cleans up and serves", "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-killstore");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(Options(dir, 1));
  cluster.Start();
  // The worker holds its job right after reporting the first checkpoint (SIGUSR1, as in the
  // worker-killed test), so the store dies while the job is mid-run however fast it trains.
  REQUIRE(::kill(cluster.WorkerPid(0), SIGUSR1) == 0);
  std::string data = WriteData(dir, 40, 11);
  int64_t first = cluster.Submit(WriteJob(dir, "during", cluster.store_name(), data, 12, 4, 1));
  WaitUntil([&] { return cluster.ShowJob(first).value("checkpoint_step", 0) >= 4; }, 300,
            "the first checkpoint");
  nlohmann::json job = cluster.ShowJob(first);
  REQUIRE(job["state"] == "running");
  REQUIRE(job.value("checkpoint_step", 0) == 4);  // held there: it cannot have gone further
  cluster.StopStore(SIGKILL);
  REQUIRE(::kill(cluster.WorkerPid(0), SIGUSR2) == 0);  // trains on, on the mapped weights
  nlohmann::json jobs = cluster.WaitForJobs(600);
  INFO(jobs.dump());
  job = cluster.ShowJob(first);
  CHECK(job["state"] == "succeeded");
  CHECK(job.value("attempt", 0) == 1);  // finished by the run that was going when it died

  cluster.StartStore();  // finds the dead store's segments, removes them, publishes anew
  int64_t second = cluster.Submit(WriteJob(dir, "after", cluster.store_name(), data, 4, 2, 2));
  cluster.WaitForJobs(600);
  CHECK(cluster.ShowJob(second)["state"] == "succeeded");
}

TEST_CASE("the coordinator restarted mid-run loses no job", "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-restart");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(Options(dir, 2));
  cluster.Start();
  std::vector<int64_t> ids;
  for (int j = 0; j < 3; ++j)
    ids.push_back(cluster.Submit(WriteJob(dir, "r" + std::to_string(j), cluster.store_name(),
                                          WriteData(dir, 40, 200 + j), 10, 2, j)));
  WaitUntil([&] { return cluster.ShowJob(ids[0]).value("step", 0) >= 2; }, 300, "training");
  const nlohmann::json before = nlohmann::json::parse(cluster.Client({"jobs", "--json"}));
  cluster.StopCoordinator(SIGKILL);
  // The workers train on while the coordinator is down (unless every job was done already).
  const size_t at_kill = StepsWritten(before);
  WaitUntil([&] { return StepsWritten(before) > at_kill || at_kill == 30; }, 300,
            "a step trained while the coordinator is down");
  cluster.StartCoordinator();  // same journal, same endpoint
  nlohmann::json jobs = cluster.WaitForJobs(900);
  REQUIRE(jobs.size() == 3);
  for (const auto& job : jobs) {
    INFO(job.dump());
    CHECK(job["state"] == "succeeded");
  }
}

TEST_CASE("the store and four training workers hold the base weights once", "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-pss");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(Options(dir, 4));
  cluster.Start();
  std::vector<int64_t> ids;
  for (int j = 0; j < 4; ++j)
    ids.push_back(cluster.Submit(WriteJob(dir, "m" + std::to_string(j), cluster.store_name(),
                                          WriteData(dir, 40, 300 + j), 100000, 0, j)));
  lorastream::testing::CheckBaseHeldOnce(cluster, ids, 1024);
  for (int64_t id : ids) cluster.Client({"cancel", std::to_string(id)});
  cluster.WaitForJobs(300);
}

TEST_CASE("`lorastream up` trains a job end to end, says where the adapter is, leaves nothing",
          "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-up");
  const std::string& dir = run_dir.str();
  std::string data = WriteData(dir, 30, 11);
  std::string job = WriteJob(dir, "upjob", "replaced-by-up", data, 6, 3, 1);
  int code = -1;
  // CPU workers, whatever this machine has: an empty GPU folder hides its GPUs from `up`
  // (common/posix/gpu_info.h), so that the two CPU workers and their split of the cores are tested.
  fs::create_directories(dir + "/no-gpus");
  ::setenv("LORASTREAM_NVIDIA_GPUS_DIR", (dir + "/no-gpus").c_str(), 1);
  std::string out =
      lorastream::RunAndCapture({std::string(LORASTREAM_BIN_DIR) + "/lorastream", "up", "--run-dir",
                                 dir + "/run", "--no-watch", "--job", job, "--cpu-workers", "2"},
                                &code, 600, dir + "/up.stderr");
  ::unsetenv("LORASTREAM_NVIDIA_GPUS_DIR");
  INFO(out);
  REQUIRE(code == 0);
  CHECK_THAT(out, Catch::Contains("2 worker(s): cpu cpu"));
  CHECK_THAT(out, Catch::Contains("succeeded  step 6/6, "));
  CHECK_THAT(out, Catch::Contains(" tok/s, stall "));
  CHECK_THAT(out, Catch::Contains(dir + "/run/adapters/upjob"));
  CHECK_THAT(out, Catch::Contains("stopped; logs in " + dir + "/run/logs"));
  CHECK(fs::exists(dir + "/run/adapters/upjob/adapter_model.safetensors"));
  CHECK(fs::exists(dir + "/run/model/config.json"));  // the synthesized tiny model
  // The store it started is gone, and its segments with it.
  const size_t at = out.find("store `");
  REQUIRE(at != std::string::npos);
  const std::string store = out.substr(at + 7, out.find('`', at + 7) - at - 7);
  REQUIRE(!store.empty());
  for (const auto& entry : fs::directory_iterator("/dev/shm"))
    CHECK(entry.path().filename().string().rfind(lorastream::ShmPrefix(store), 0) != 0);
}

TEST_CASE(
    "`up --detach` returns with the job submitted; `down` stops the cluster, leaves no socket",
    "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-detach");
  const std::string& dir = run_dir.str();
  // A relative eval.path next to a relative data.path: both made absolute in up's copy.
  const std::string data = fs::path(WriteData(dir, 30, 41)).filename().string();
  fs::copy_file(dir + "/" + data, dir + "/val.jsonl");
  const std::string job = dir + "/detached.toml";
  std::ofstream(job) << "name = \"detached\"\n[model]\nstore = \"replaced-by-up\"\n"
                     << "[data]\npath = \"" << data << "\"\nseq_len = 32\n[lora]\nrank = 4\n"
                     << "[train]\nsteps = 4\noutput_dir = \"mine\"\n[eval]\npath = \"val.jsonl\"\n";
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream";
  int code = -1;
  const std::string out = lorastream::RunAndCapture(
      {bin, "up", "--run-dir", dir + "/run", "--detach", "--device", "cpu", "--job", job}, &code,
      600, dir + "/up.stderr");
  INFO(out << lorastream::testing::ReadAll(dir + "/up.stderr"));
  REQUIRE(code == 0);
  CHECK_THAT(out, Catch::Contains("its output_dir " + dir + "/mine is replaced by " + dir +
                                  "/run/adapters/detached"));
  const nlohmann::json cluster =
      nlohmann::json::parse(lorastream::testing::ReadAll(dir + "/run/cluster.json"));
  const std::string endpoint = cluster["endpoint"];
  const std::string socket = endpoint.substr(6);
  CHECK(fs::exists(socket));
  // The job trains on while `up` is gone.
  WaitUntil(
      [&] {
        int c = -1;
        const std::string jobs =
            lorastream::RunAndCapture({bin, "--coordinator", endpoint, "jobs", "--json"}, &c, 30);
        return c == 0 && jobs.find("\"succeeded\"") != std::string::npos;
      },
      300, "the detached job to succeed");
  const std::string down =
      lorastream::RunAndCapture({bin, "down", dir + "/run"}, &code, 120, dir + "/down.stderr");
  INFO(down << lorastream::testing::ReadAll(dir + "/down.stderr"));
  CHECK(code == 0);
  CHECK_THAT(down, Catch::Contains("stopped coordinator") && Catch::Contains("stopped store"));
  // Stopped: gone, or a zombie that a non-reaping init (a container's) has not collected.
  auto running = [](pid_t pid) {
    if (::kill(pid, 0) != 0) return false;
    const std::string stat = lorastream::testing::ReadAll("/proc/" + std::to_string(pid) + "/stat");
    const size_t paren = stat.rfind(')');
    return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
  };
  for (const auto& part : cluster["parts"]) CHECK_FALSE(running(part["pid"].get<pid_t>()));
  CHECK_FALSE(fs::exists(socket));
}

TEST_CASE("`lorastream up --jobs-per-gpu 2` gives its workers two job slots", "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-upslots");
  const std::string& dir = run_dir.str();
  std::vector<std::string> argv = {std::string(LORASTREAM_BIN_DIR) + "/lorastream",
                                   "up",
                                   "--run-dir",
                                   dir + "/run",
                                   "--no-watch",
                                   "--device",
                                   "cpu",
                                   "--jobs-per-gpu",
                                   "2"};
  for (int j = 0; j < 2; ++j) {
    const std::string data = WriteData(dir, 30, 300 + j);
    argv.insert(argv.end(), {"--job", WriteJob(dir, "up" + std::to_string(j), "replaced-by-up",
                                               data, 6, 3, j)});
  }
  int code = -1;
  const std::string out = lorastream::RunAndCapture(argv, &code, 600, dir + "/up.stderr");
  const std::string log = lorastream::testing::ReadAll(dir + "/run/logs/worker-0.log");
  INFO(out << log);
  REQUIRE(code == 0);
  CHECK_THAT(out, Catch::Contains("1 worker(s): cpu, each training up to 2 jobs at once"));
  CHECK_THAT(log, Catch::Contains("job slots: 2 (--jobs)"));
  CHECK_THAT(log, Catch::Contains("2 job slots"));
  for (int j = 0; j < 2; ++j)
    CHECK(fs::exists(dir + "/run/adapters/up" + std::to_string(j) + "/adapter_model.safetensors"));
}

TEST_CASE(
    "an eval split and epochs through a real cluster: eval loss in stats, show and "
    "TensorBoard files an independent reader decodes",
    "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-eval");
  const std::string dir = run_dir.str();
  LocalClusterOptions options = Options(dir, 1);
  options.tensorboard_dir = dir + "/tb";
  LocalCluster cluster(options);
  cluster.Start();
  std::string data = WriteData(dir, 30, 21);
  std::string job = dir + "/evaljob.toml";
  {
    std::ofstream out(job);
    out << "name = \"eval job\"\n[model]\nstore = \"" << cluster.store_name() << "\"\n"
        << "[data]\npath = \"" << data << "\"\nseq_len = 32\n[lora]\nrank = 4\n"
        << "[train]\nepochs = 0.25\nbatch_size = 2\noutput_dir = \"" << dir << "/out\"\n"
        << "[eval]\nsplit = 0.2\nevery = 2\nbatches = 2\n";
  }
  // submit shows the steps the epochs make, as the worker will compute them.
  std::string submitted = cluster.Client({"submit", job});
  INFO(submitted);
  CHECK_THAT(submitted,
             Catch::Contains(" eval sequences from 6 held-out documents; 0.25 epochs = "));
  nlohmann::json jobs = cluster.WaitForJobs(600);
  REQUIRE(jobs.size() == 1);
  INFO(jobs.dump());
  REQUIRE(jobs[0]["state"] == "succeeded");
  const int64_t steps = jobs[0]["total_steps"];
  const int64_t id = jobs[0]["id"];
  CHECK(steps > 2);
  CHECK(jobs[0]["step"] == steps);
  // The worker's first line about the job says the same.
  std::ifstream log(cluster.log_dir() + "/worker-0.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("0.25 epochs = " + std::to_string(steps) + " steps"));

  // Evaluations at every second step and the last one, in stats.jsonl and through `stats`.
  std::vector<int64_t> expected;
  for (int64_t s = 1; s <= steps; ++s)
    if (s % 2 == 0 || s == steps) expected.push_back(s);
  std::vector<int64_t> in_file;
  std::ifstream stats_file(dir + "/out/stats.jsonl");
  for (std::string line; std::getline(stats_file, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("eval_loss")) in_file.push_back(j["step"]);
  }
  CHECK(in_file == expected);
  nlohmann::json exported =
      nlohmann::json::parse(cluster.Client({"stats", std::to_string(id), "--format", "json"}));
  std::vector<int64_t> exported_steps;
  for (const auto& row : exported["stats"])
    if (row.contains("eval_loss")) exported_steps.push_back(row["step"]);
  CHECK(exported_steps == expected);
  std::string shown = cluster.Client({"show", std::to_string(id)});
  CHECK_THAT(shown, Catch::Contains("eval loss:   "));
  CHECK_THAT(shown, Catch::Contains(" at step " + std::to_string(steps) + " (lowest "));
  cluster.Stop();

  // The TensorBoard run of the job, decoded by an independent reader (CRCs and protobuf).
  int code = -1;
  std::string decoded = lorastream::RunAndCapture(
      {"python3", std::string(LORASTREAM_SOURCE_DIR) + "/tests/tools/read_tfevents.py",
       dir + "/tb"},
      &code, 60, dir + "/reader.stderr");
  REQUIRE(code == 0);
  nlohmann::json run =
      nlohmann::json::parse(decoded)["runs"]["job-" + std::to_string(id) + "-eval_job"];
  REQUIRE(run.is_object());
  CHECK(run["file_version"] == "brain.Event:2");
  CHECK(run["scalars"]["train/loss"].size() == static_cast<size_t>(steps));
  CHECK(run["scalars"]["eval/loss"].size() == expected.size());
  CHECK(run["scalars"]["eval/loss"].back()[0] == steps);
  CHECK(run["scalars"]["perf/tokens_per_second"][0][1] > 0);
  for (const char* tag : {"train/learning_rate", "train/grad_norm", "perf/stall_seconds",
                          "perf/h2d_gb_per_s", "perf/peak_memory_gib"})
    CHECK(run["scalars"][tag].size() == static_cast<size_t>(steps));
}

TEST_CASE("`lorastream up --tensorboard` refuses a folder it cannot write before starting",
          "[e2e]") {
  const lorastream::testing::TempDir run_dir("e2e-tbbad");
  const std::string dir = run_dir.str();
  std::ofstream(dir + "/file") << "x";
  int code = -1;
  lorastream::RunAndCapture({std::string(LORASTREAM_BIN_DIR) + "/lorastream", "up", "--run-dir",
                             dir + "/run", "--no-watch", "--tensorboard", dir + "/file/tb"},
                            &code, 120, dir + "/up.stderr");
  CHECK(code == 2);
  std::ifstream err(dir + "/up.stderr");
  std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains(dir + "/file/tb"));
  CHECK_FALSE(fs::exists(dir + "/run/logs"));  // nothing started
}
