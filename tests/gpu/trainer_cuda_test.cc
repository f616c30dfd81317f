// A training job on CUDA through the trainer: fully resident and streamed, every step's
// statistics carry the peak device memory (DESIGN.md: statistics per step), the streamed
// run's loss stays within bf16 rounding of the resident one, and checkpoints every step
// replace the older ones (with the wheel's LibTorch, std::filesystem::remove_all crashed
// there: common/remove_tree.h).
#include <cmath>
#include <filesystem>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/worker/worker_test_util.h"
#include "worker/cuda/cuda_memory.h"
#include "worker/stream_provider.h"
#include "worker/trainer.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

namespace {

// Training on cuda:0 from scratch; with `streamed`, the streaming engine as the provider (the
// job's [stream] plan), as lorastream-worker train runs it.
TrainOptions CudaTrainOptions(bool streamed) {
  TrainOptions o;
  o.device = "cuda:0";
  o.resume = false;
  if (streamed)
    o.make_provider = [](const JobSpec& j, const BaseWeights& b, const std::string& d,
                         const std::string& dt) { return MakeStreamProvider(j, b, d, dt); };
  return o;
}

}  // namespace

TEST_CASE("CUDA training: every step reports peak device memory, resident and streamed", "[gpu]") {
  TempDir dir("cuda-trainer");
  const std::string model = MakeCheckpoint(dir / "model", "tiny");
  const std::string data = WriteJsonl(dir / "d.jsonl", 16, 40, 80, 512);
  std::vector<double> losses[2];
  for (int streamed = 0; streamed < 2; ++streamed) {
    CAPTURE(streamed);
    JobSpec spec = TinyJob(model, data, dir / (streamed ? "streamed" : "resident"));
    spec.stream.blocks_to_swap = streamed ? 2 : 0;
    spec.stream.ring_size = 1;
    spec.train.checkpoint_every = 1;
    std::vector<StepStats> steps;
    RunTraining(spec, CudaTrainOptions(streamed == 1),
                [&](const StepStats& s) { steps.push_back(s); });
    REQUIRE(steps.size() == static_cast<size_t>(spec.train.steps));
    for (const StepStats& s : steps) {
      CHECK(s.peak_device_bytes > 0);
      CHECK(std::isfinite(s.loss));
      CHECK((s.h2d_bytes > 0) == (streamed == 1));
      losses[streamed].push_back(s.loss);
    }
    int checkpoints = 0;
    for (const auto& e : std::filesystem::directory_iterator(spec.train.output_dir))
      checkpoints += e.path().filename().string().rfind("checkpoint-", 0) == 0;
    CHECK(checkpoints == 2);  // the newest train.keep_checkpoints (default 2) are kept
  }
  for (size_t i = 0; i < losses[0].size(); ++i)
    CHECK(losses[1][i] == Approx(losses[0][i]).epsilon(2e-2));
}

TEST_CASE("CUDA: a job naming no plan plans within the device's free memory and trains", "[gpu]") {
  TempDir dir("cuda-auto-budget");
  const std::string model = MakeCheckpoint(dir / "model", "tiny");
  const std::string data = WriteJsonl(dir / "d.jsonl", 16, 40, 80, 512);
  JobSpec spec = TinyJob(model, data, dir / "out");
  spec.stream.budget_auto = true;  // what a job file without a plan of its own asks for
  const uint64_t free_before = CudaFreeBytes(0);
  const uint64_t budget = JobMemoryBudget(spec.stream, c10::Device("cuda:0"));
  CHECK(budget > free_before / 2);
  CHECK(budget < free_before);
  std::vector<StepStats> steps;
  RunTraining(spec, CudaTrainOptions(/*streamed=*/true),
              [&](const StepStats& s) { steps.push_back(s); });
  REQUIRE(steps.size() == static_cast<size_t>(spec.train.steps));
  for (const StepStats& s : steps) {
    CHECK(std::isfinite(s.loss));
    CHECK(s.h2d_bytes == 0);  // the tiny model fits: nothing streams
    CHECK(s.peak_device_bytes < budget);
  }
}
