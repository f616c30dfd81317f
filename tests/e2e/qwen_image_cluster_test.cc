// Qwen-Image end to end: the example Qwen-Image job (configs/jobs/qwen_image_tiny.toml, beside
// a synthesized qwen-image-tiny checkpoint and caches, as docs/QWEN_IMAGE.md shows) submitted
// to a coordinator and trained by a CPU worker, which reads the job's checkpoint itself; and
// `lorastream up --job` serving the checkpoint the job names from a store, its CPU worker
// training the job from the store's one copy. Either way the adapters equal the same job
// trained standalone from the checkpoint, byte for byte, and so does every step's loss. And a
// store of the preset with two workers training from it: the host holds the base once.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "common/posix/subprocess.h"
#include "coordinator/cli/local_cluster.h"
#include "tests/e2e/e2e_jobs.h"
#include "tests/support/test_support.h"

using lorastream::cli::LocalCluster;
using lorastream::cli::LocalClusterOptions;
using lorastream::testing::ReadAll;
using lorastream::testing::TrainStandalone;
namespace fs = std::filesystem;

namespace {

const std::string kBin = LORASTREAM_BIN_DIR;

// DIR/qi: the checkpoint, DIR/qi/cache, and the example job as DIR/qi/NAME.toml writing into
// DIR/qi/OUTPUT.
std::string ExampleJob(const std::string& dir, const std::string& name, const std::string& output) {
  if (!fs::exists(dir + "/qi/qwen_image.safetensors")) {
    int code = -1;
    lorastream::RunAndCapture({kBin + "/lorastream-synth", "--preset", "qwen-image-tiny", "--out",
                               dir + "/qi", "--caches", dir + "/qi/cache"},
                              &code, 120, dir + "/synth.log");
    REQUIRE(code == 0);
  }
  // As the README shows: copied, its output folder appended ([train] is its last section).
  const std::string path = dir + "/qi/" + name + ".toml";
  std::ofstream(path) << ReadAll(std::string(LORASTREAM_SOURCE_DIR) +
                                 "/configs/jobs/qwen_image_tiny.toml")
                      << "output_dir = \"" << output << "\"\n";
  return path;
}

// Every step's loss in a job's stats.jsonl, by step.
std::map<int64_t, double> Losses(const std::string& stats_file) {
  std::map<int64_t, double> losses;
  std::istringstream in(ReadAll(stats_file));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j.contains("loss"))
      losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return losses;
}

// A local cluster of `workers` CPU workers under DIR/cluster, its store of `preset`.
LocalClusterOptions CpuCluster(const std::string& dir, const std::string& preset, size_t workers,
                               const std::string& store_prefix) {
  LocalClusterOptions o;
  o.bin_dir = kBin;
  o.run_dir = dir + "/cluster";
  o.preset = preset;
  o.devices.assign(workers, "cpu");
  o.heartbeat_timeout_s = 3;
  o.store_name = store_prefix + std::to_string(getpid());
  return o;
}

}  // namespace

TEST_CASE(
    "Qwen-Image through the coordinator: the example job trains on a CPU worker as it does "
    "standalone, byte for byte",
    "[e2e][qwen_image]") {
  const lorastream::testing::TempDir run_dir("e2e-qwen-image");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(CpuCluster(dir, "tiny", 1, "e2e-qi-"));
  cluster.Start();
  const std::string job = ExampleJob(dir, "cluster", "out-cluster");
  const int64_t id = std::stoll(cluster.Client({"submit", job, "--quiet"}));
  cluster.WaitForJobs(300);
  const nlohmann::json shown = cluster.ShowJob(id);
  INFO(shown.dump(2));
  REQUIRE(shown["state"] == "succeeded");

  TrainStandalone(ExampleJob(dir, "alone", "out-alone"), dir + "/alone.log");
  for (const char* file : {"adapter_comfyui.safetensors", "pytorch_lora_weights.safetensors"}) {
    INFO(file);
    const std::string a = ReadAll(dir + "/qi/out-cluster/" + file);
    CHECK(!a.empty());
    CHECK(a == ReadAll(dir + "/qi/out-alone/" + file));
  }
  CHECK(fs::is_directory(dir + "/qi/out-cluster/checkpoint-20"));
}

TEST_CASE(
    "`lorastream up --job` trains a Qwen-Image job from a store of the checkpoint it names, equal "
    "to the job trained standalone from the checkpoint, byte for byte",
    "[e2e][qwen_image][up]") {
  const lorastream::testing::TempDir run_dir("e2e-qwen-image-up");
  const std::string& dir = run_dir.str();
  const std::string job = ExampleJob(dir, "qi", "replaced-by-up");
  int code = -1;
  const std::string out =
      lorastream::RunAndCapture({kBin + "/lorastream", "up", "--job", job, "--device", "cpu",
                                 "--run-dir", dir + "/run", "--no-watch"},
                                &code, 600, dir + "/up.stderr");
  INFO(out << ReadAll(dir + "/up.stderr"));
  REQUIRE(code == 0);
  // The store serves the checkpoint the job names; the job sent names the store instead.
  CHECK_THAT(out, Catch::Contains("(" + dir + "/qi/qwen_image.safetensors)"));
  CHECK_THAT(out, Catch::Contains("1 worker(s): cpu"));
  CHECK_THAT(out, Catch::Contains("qwen-image-tiny-demo     succeeded  step 20/20, "));
  CHECK_THAT(out, Catch::Contains(dir + "/run/adapters/qi"));
  const std::string sent = ReadAll(dir + "/run/jobs/qi.toml");
  INFO(sent);
  CHECK_THAT(sent, Catch::Contains("store = ") && !Catch::Contains("checkpoint = ") &&
                       Catch::Contains(dir + "/qi/cache"));
  CHECK_THAT(ReadAll(dir + "/run/logs/store.log"),
             Catch::Contains("published: 2 Qwen-Image blocks + rest"));
  // The worker trains from the store's mapping, not from the checkpoint.
  CHECK_THAT(
      ReadAll(dir + "/run/logs/worker-0.log"),
      Catch::Contains("Qwen-Image store `") && Catch::Contains("joins the Qwen-Image group"));

  TrainStandalone(ExampleJob(dir, "alone", "out-alone"), dir + "/alone.log");
  for (const char* file : {"adapter_comfyui.safetensors", "pytorch_lora_weights.safetensors"}) {
    INFO(file);
    const std::string a = ReadAll(dir + "/run/adapters/qi/" + file);
    CHECK(!a.empty());
    CHECK(a == ReadAll(dir + "/qi/out-alone/" + file));
  }
  const std::map<int64_t, double> losses = Losses(dir + "/run/adapters/qi/stats.jsonl");
  CHECK(losses.size() == 20);
  CHECK(losses == Losses(dir + "/qi/out-alone/stats.jsonl"));

  // A job starting from an adapter named relative to its folder (lora.init_from): the copy
  // `up` sends names it absolute, and the job trains from it.
  std::string from = ReadAll(job);
  from.replace(from.find("[lora]\n"), 7, "[lora]\ninit_from = \"out-alone\"\n");
  std::ofstream(dir + "/qi/from.toml") << from;
  const std::string again =
      lorastream::RunAndCapture({kBin + "/lorastream", "up", "--job", dir + "/qi/from.toml",
                                 "--device", "cpu", "--run-dir", dir + "/run-from", "--no-watch"},
                                &code, 600, dir + "/up-from.stderr");
  INFO(again << ReadAll(dir + "/up-from.stderr"));
  CHECK(code == 0);
  CHECK_THAT(ReadAll(dir + "/run-from/jobs/from.toml"),
             Catch::Contains("init_from = '" + dir + "/qi/out-alone'") ||
                 Catch::Contains("init_from = \"" + dir + "/qi/out-alone\""));
  CHECK_THAT(again, Catch::Contains("succeeded  step 20/20, "));
}

TEST_CASE("`lorastream up` of Qwen-Image without a job names one to give, starting nothing",
          "[e2e][qwen_image][up]") {
  const lorastream::testing::TempDir run_dir("e2e-qwen-image-up-nojob");
  const std::string& dir = run_dir.str();
  int code = -1;
  lorastream::RunAndCapture({kBin + "/lorastream", "up", "--preset", "qwen-image-tiny", "--device",
                             "cpu", "--run-dir", dir + "/run", "--no-watch"},
                            &code, 120, dir + "/up.log");
  CHECK(code != 0);
  CHECK_THAT(ReadAll(dir + "/up.log"),
             Catch::Contains("no Qwen-Image example job") && Catch::Contains("--job"));
  CHECK_FALSE(fs::exists(dir + "/run/logs"));  // nothing started
}

TEST_CASE("a Qwen-Image store and two workers training from it hold the base weights once",
          "[e2e][qwen_image]") {
  const lorastream::testing::TempDir run_dir("e2e-qwen-image-pss");
  const std::string& dir = run_dir.str();
  LocalCluster cluster(CpuCluster(dir, "qwen-image-tiny", 2, "e2e-qi-pss-"));
  cluster.Start();
  REQUIRE(cluster.family() == lorastream::ModelFamily::kQwenImage);
  // The example job (its caches beside it), long enough to be running when measured; Submit
  // names the cluster's store instead of the checkpoint.
  std::string text = ReadAll(ExampleJob(dir, "example", "unused"));
  text.replace(text.find("steps = 20"), 10, "steps = 100000");
  std::vector<int64_t> ids;
  for (int j = 0; j < 2; ++j) {
    std::string job = text;
    job.replace(job.find("seed = 0"), 8, "seed = " + std::to_string(j));
    const std::string path = dir + "/qi/m" + std::to_string(j) + ".toml";
    std::ofstream(path) << job;
    ids.push_back(cluster.Submit(path));
  }
  lorastream::testing::CheckBaseHeldOnce(cluster, ids, 64);  // each job alone on its worker
  for (int64_t id : ids) cluster.Client({"cancel", std::to_string(id)});
  cluster.WaitForJobs(300);
}
