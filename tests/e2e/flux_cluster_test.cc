// FLUX.1 end to end: a store serving flux-tiny, CPU workers and a coordinator (what
// `lorastream up --preset flux-tiny` starts), the example FLUX job submitted and trained
// through the coordinator into adapters that load, a worker killed mid-job whose job resumes
// from its own checkpoint elsewhere and ends bit-identical to a standalone run, and a FLUX job
// no worker can serve waiting with its reason; two FLUX jobs trained as one group by a 2-slot
// worker, killed mid-run, each resuming from its own checkpoint.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include <catch2/catch.hpp>

#include "common/formats/safetensors.h"
#include "common/job/job_spec.h"
#include "common/posix/subprocess.h"
#include "coordinator/cli/local_cluster.h"
#include "tests/e2e/e2e_jobs.h"
#include "tests/support/test_support.h"

using lorastream::cli::LocalCluster;
using lorastream::cli::LocalClusterOptions;
using lorastream::testing::ReadAll;
using lorastream::testing::TrainStandalone;
using lorastream::testing::WaitUntil;
namespace fs = std::filesystem;

namespace {

// flux-tiny synthesized and served, two CPU workers, a coordinator.
LocalClusterOptions FluxCluster(const std::string& run_dir, const std::string& store_prefix) {
  LocalClusterOptions o;
  o.bin_dir = LORASTREAM_BIN_DIR;
  o.run_dir = run_dir;
  o.preset = "flux-tiny";
  o.devices.assign(2, "cpu");
  o.heartbeat_timeout_s = 3;
  o.store_name = store_prefix + std::to_string(getpid());
  return o;
}

}  // namespace

TEST_CASE(
    "FLUX through the coordinator: the example job trains from the store; a killed worker's job "
    "resumes bit-identical",
    "[e2e][flux]") {
  const lorastream::testing::TempDir run_dir("e2e-flux");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(FluxCluster(dir, "e2e-flux-"));
  cluster.Start();
  REQUIRE(cluster.family() == lorastream::ModelFamily::kFlux);
  CHECK(fs::path(cluster.model_dir()).filename() == "flux1.safetensors");

  // A FLUX job on a store no worker offers waits, saying why, until cancelled.
  const std::string lost = dir + "/lost.toml";
  std::ofstream(lost) << "name = \"lost\"\n[flux]\nstore = \"no-such-flux-store\"\n"
                         "cache_dir = \""
                      << LORASTREAM_SOURCE_DIR
                      << "/configs/data/flux-tiny\"\noutput_dir = \"lost-out\"\nsteps = 2\n";
  const int64_t waiting = std::stoll(cluster.Client({"submit", lost, "--quiet"}));
  const nlohmann::json queued = cluster.ShowJob(waiting);
  CHECK(queued["state"] == "queued");
  CHECK(queued.value("reason", "") == "waiting for a worker offering store `no-such-flux-store`");
  cluster.Client({"cancel", std::to_string(waiting)});
  // An LLM job naming the FLUX store is refused at submission, naming the key.
  const std::string llm = lorastream::testing::WriteJob(
      dir, "llm", cluster.store_name(), lorastream::testing::WriteData(dir, 4, 1), 2, 0, 0);
  int code = 0;
  const std::string refused = cluster.Client({"submit", llm, "--json"}, &code);
  CHECK(code != 0);
  CHECK_THAT(refused, Catch::Contains("key `model.store`: store `" + cluster.store_name() +
                                      "` serves FLUX.1; an LLM job names an LLM's store"));

  // Every worker holds the job it runs right after reporting its first checkpoint (SIGUSR1),
  // so the job is mid-run when its worker is killed.
  for (size_t i = 0; i < cluster.num_workers(); ++i)
    REQUIRE(::kill(cluster.WorkerPid(i), SIGUSR1) == 0);
  const int64_t id =
      cluster.Submit(std::string(LORASTREAM_SOURCE_DIR) + "/configs/jobs/flux_tiny.toml");
  WaitUntil([&] { return cluster.ShowJob(id).value("checkpoint_step", 0) >= 10; }, 300,
            "the FLUX job's first checkpoint");
  nlohmann::json job = cluster.ShowJob(id);
  REQUIRE(job["state"] == "running");
  REQUIRE(job.value("checkpoint_step", 0) == 10);
  REQUIRE(job.value("step", 0) < 20);
  CHECK(cluster.Client({"jobs"}).find("flux-tiny-demo") != std::string::npos);
  const size_t victim = lorastream::testing::WorkerRunningOnly(cluster, id);
  REQUIRE(::kill(cluster.WorkerPid(1 - victim), SIGUSR2) == 0);
  cluster.StopWorker(victim, SIGKILL);
  cluster.WaitForJobs(600);
  job = cluster.ShowJob(id);
  INFO(job.dump());
  REQUIRE(job["state"] == "succeeded");
  CHECK(job.value("attempt", 0) >= 2);
  CHECK(job["last_stats"].value("step", 0) == 20);
  CHECK(std::isfinite(job["last_stats"].value("loss", NAN)));
  const std::string out = job["output_dir"];
  const auto kohya = lorastream::SafetensorsFile::Open(out + "/adapter_kohya.safetensors");
  CHECK(kohya.Find("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight") != nullptr);
  const auto diffusers =
      lorastream::SafetensorsFile::Open(out + "/pytorch_lora_weights.safetensors");
  CHECK(diffusers.Find("transformer.transformer_blocks.0.attn.to_q.lora_A.weight") != nullptr);

  // The same job standalone (`lorastream-worker train`, from the same store) ends with the
  // same bytes: the requeued attempt resumed from checkpoint-10 exactly.
  const std::string submitted = dir + "/jobs/flux_tiny.toml";
  lorastream::JobSpec spec = lorastream::ParseJobSpec(ReadAll(submitted), submitted);
  spec.flux.output_dir = dir + "/standalone";
  const std::string alone = dir + "/flux_alone.toml";
  std::ofstream(alone) << lorastream::JobSpecToToml(spec);
  TrainStandalone(alone, cluster.log_dir() + "/standalone.log");
  CHECK(ReadAll(dir + "/standalone/adapter_kohya.safetensors") ==
        ReadAll(out + "/adapter_kohya.safetensors"));
  CHECK(ReadAll(dir + "/standalone/pytorch_lora_weights.safetensors") ==
        ReadAll(out + "/pytorch_lora_weights.safetensors"));

  // `stats` has every step; a running FLUX job cancelled stops at the end of its step, its
  // checkpoint saved.
  const std::string csv = cluster.Client({"stats", std::to_string(id)});
  CHECK(std::count(csv.begin(), csv.end(), '\n') >= 21);  // a header and 20 steps
  spec.name = "flux-long";
  spec.flux.steps = 100000;
  const std::string long_job = dir + "/flux_long.toml";
  std::ofstream(long_job) << lorastream::JobSpecToToml(spec);
  const int64_t cancelled = cluster.Submit(long_job);
  WaitUntil([&] { return cluster.ShowJob(cancelled).value("step", 0) >= 2; }, 300,
            "the long FLUX job's second step");
  cluster.Client({"cancel", std::to_string(cancelled)});
  cluster.WaitForJobs(300);
  job = cluster.ShowJob(cancelled);
  INFO(job.dump());
  CHECK(job["state"] == "cancelled");
  const int64_t saved = job.value("checkpoint_step", 0);
  CHECK(saved >= 2);
  CHECK(fs::exists(job.value("output_dir", "") + "/checkpoint-" + std::to_string(saved) +
                   "/adapter_kohya.safetensors"));
}

TEST_CASE(
    "a 2-slot worker trains two FLUX jobs as one group; killed mid-run, both resume elsewhere "
    "and end as their standalone runs, byte for byte",
    "[e2e][flux]") {
  const lorastream::testing::TempDir run_dir("e2e-flux-group");
  const std::string& dir = run_dir.str();
  LocalClusterOptions options = FluxCluster(dir, "e2e-flux-group-");
  options.jobs_per_worker = 2;
  LocalCluster cluster(options);
  cluster.Start();
  // Both jobs go to worker 0 (worker 1 waits until they have checkpoints, worker 0 comes back
  // once both are queued); it then holds its group at the next checkpoint it reports (SIGUSR1),
  // so both are mid-run when it is killed.
  cluster.StopWorker(1, SIGTERM);
  cluster.StopWorker(0, SIGTERM);
  const std::string log0 = cluster.log_dir() + "/worker-0.log";
  constexpr int kSteps = 24, kEvery = 2;
  std::vector<int64_t> ids;
  for (int j = 0; j < 2; ++j) {
    const std::string job = dir + "/fgroup" + std::to_string(j) + ".toml";
    std::ofstream(job) << "name = \"fgroup" << j << "\"\n[flux]\nstore = \"replaced\"\n"
                       << "cache_dir = \"" << LORASTREAM_SOURCE_DIR
                       << "/configs/data/flux-tiny\"\noutput_dir = \"out\"\nsteps = " << kSteps
                       << "\nsave_every = " << kEvery << "\nrank = " << 4 + 4 * j
                       << "\nseed = " << 30 + j << "\nlearning_rate = 1e-3\nblocks_to_swap = 2\n"
                       << (j == 1 ? "targets = [\"attention\"]\n" : "");
    ids.push_back(cluster.Submit(job));
  }
  cluster.StartWorker(0);
  WaitUntil(
      [&] {
        return cluster.ShowJob(ids[0]).value("checkpoint_step", 0) >= kEvery &&
               cluster.ShowJob(ids[1]).value("checkpoint_step", 0) >= kEvery;
      },
      300, "a checkpoint of each job of the FLUX group");
  REQUIRE(::kill(cluster.WorkerPid(0), SIGUSR1) == 0);
  WaitUntil([&] { return ReadAll(log0).find("holding after checkpoint") != std::string::npos; },
            300, "worker 0 holding its group");
  for (int64_t id : ids) {
    const nlohmann::json job = cluster.ShowJob(id);
    INFO(job.dump() << ReadAll(log0));
    REQUIRE(job["state"] == "running");
    REQUIRE(job.value("step", 0) < kSteps);
    REQUIRE(job.value("attempt", 0) == 1);
  }
  CHECK_THAT(ReadAll(log0), Catch::Contains("joins the FLUX group (2 jobs)"));
  cluster.StartWorker(1);  // not held: it trains both jobs to their end
  cluster.StopWorker(0, SIGKILL);
  cluster.WaitForJobs(900);
  const std::string log1 = ReadAll(cluster.log_dir() + "/worker-1.log");
  for (int j = 0; j < 2; ++j) {
    const nlohmann::json job = cluster.ShowJob(ids[j]);
    INFO(job.dump() << log1);
    REQUIRE(job["state"] == "succeeded");
    CHECK(job.value("attempt", 0) == 2);
    const std::string out = job["output_dir"];
    CHECK_THAT(log1, Catch::Contains("job fgroup" + std::to_string(j) + ": resuming from " + out +
                                     "/checkpoint-"));
    // The same job standalone (`lorastream-worker train`, from the same store).
    const std::string submitted = dir + "/jobs/fgroup" + std::to_string(j) + ".toml";
    lorastream::JobSpec spec = lorastream::ParseJobSpec(ReadAll(submitted), submitted);
    spec.flux.output_dir = dir + "/standalone" + std::to_string(j);
    const std::string alone = dir + "/fgroup_alone" + std::to_string(j) + ".toml";
    std::ofstream(alone) << lorastream::JobSpecToToml(spec);
    TrainStandalone(alone, cluster.log_dir() + "/standalone" + std::to_string(j) + ".log");
    for (const char* file : {"adapter_kohya.safetensors", "pytorch_lora_weights.safetensors"})
      CHECK(ReadAll(spec.flux.output_dir + "/" + file) == ReadAll(out + "/" + file));
  }
}

TEST_CASE("`lorastream up --model FLUX_DIR` serves it and trains the example FLUX job",
          "[e2e][flux]") {
  const lorastream::testing::TempDir run_dir("e2e-flux-up");
  const std::string& dir = run_dir.str();
  int code = -1;
  lorastream::RunAndCapture({std::string(LORASTREAM_BIN_DIR) + "/lorastream-synth", "--preset",
                             "flux-tiny", "--out", dir + "/flux"},
                            &code, 120, dir + "/synth.log");
  REQUIRE(code == 0);
  const std::string out = lorastream::RunAndCapture(
      {std::string(LORASTREAM_BIN_DIR) + "/lorastream", "up", "--model", dir + "/flux", "--run-dir",
       dir + "/run", "--no-watch", "--cpu-workers", "1"},
      &code, 600, dir + "/up.stderr");
  INFO(out << ReadAll(dir + "/up.stderr"));
  REQUIRE(code == 0);
  CHECK_THAT(out, Catch::Contains("(" + dir + "/flux/flux1.safetensors)"));
  CHECK_THAT(out, Catch::Contains("configs/jobs/flux_tiny.toml as job 1"));
  CHECK_THAT(out, Catch::Contains("flux-tiny-demo           succeeded  step 20/20, "));
  CHECK_THAT(out, !Catch::Contains("tiny_llama"));  // the LLM examples are not sent
  for (const char* file : {"adapter_kohya.safetensors", "pytorch_lora_weights.safetensors"})
    CHECK(!lorastream::SafetensorsFile::Open(dir + "/run/adapters/flux_tiny/" + file)
               .tensors()
               .empty());
}

TEST_CASE("a FLUX store and two workers training from it hold the base weights once",
          "[e2e][flux]") {
  const lorastream::testing::TempDir run_dir("e2e-flux-pss");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(FluxCluster(dir, "e2e-flux-pss-"));
  cluster.Start();
  std::vector<int64_t> ids;
  for (int j = 0; j < 2; ++j) {
    const std::string job = dir + "/m" + std::to_string(j) + ".toml";
    std::ofstream(job) << "[flux]\nstore = \"replaced-by-the-cluster\"\ncache_dir = \""
                       << LORASTREAM_SOURCE_DIR
                       << "/configs/data/flux-tiny\"\noutput_dir = \"out\"\nsteps = 100000\n"
                          "rank = 4\nseed = "
                       << j << "\nblocks_to_swap = 2\n";
    ids.push_back(cluster.Submit(job));
  }
  lorastream::testing::CheckBaseHeldOnce(cluster, ids, 64);  // each job alone on its worker
  for (int64_t id : ids) cluster.Client({"cancel", std::to_string(id)});
  cluster.WaitForJobs(300);
}
