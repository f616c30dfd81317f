// Qwen-Image end to end: the example Qwen-Image job (configs/jobs/qwen_image_tiny.toml, beside
// a synthesized qwen-image-tiny checkpoint and caches, as the README shows) submitted to a
// coordinator and trained by a CPU worker, which reads the job's checkpoint itself: its
// adapters equal the same job trained standalone, byte for byte; `lorastream up` refuses it,
// saying what to use.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "common/subprocess.h"
#include "coordinator/local_cluster.h"
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

}  // namespace

TEST_CASE(
    "Qwen-Image through the coordinator: the example job trains on a CPU worker as it does "
    "standalone, byte for byte; `up` refuses it, naming what to use",
    "[e2e][qwen_image]") {
  const lorastream::testing::TempDir run_dir("e2e-qwen-image");
  const std::string& dir = run_dir.str();
  LocalClusterOptions o;
  o.bin_dir = kBin;
  o.run_dir = dir + "/cluster";
  o.preset = "tiny";
  o.devices = {"cpu"};
  o.heartbeat_timeout_s = 3;
  o.store_name = "e2e-qi-" + std::to_string(getpid());
  LocalCluster cluster(o);
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

  int code = -1;
  lorastream::RunAndCapture({kBin + "/lorastream", "up", "--job", job}, &code, 60, dir + "/up.log");
  CHECK(code != 0);
  CHECK_THAT(ReadAll(dir + "/up.log"),
             Catch::Contains("is a Qwen-Image job, which `lorastream up` does not run yet"));
}
