// A training job on CUDA through the trainer: fully resident and streamed, every step's
// statistics carry the peak device memory (DESIGN.md: statistics per step), the streamed
// run's loss stays within bf16 rounding of the resident one, and checkpoints every step
// replace the older ones (with the wheel's LibTorch, std::filesystem::remove_all crashed
// there: common/posix/remove_tree.h).
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include "common/formats/model_config.h"
#include "tests/gpu/cuda_train_options.h"
#include "tests/worker/worker_test_util.h"
#include "worker/model/lora.h"
#include "worker/stream/cuda/cuda_memory.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

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

namespace {

// LORASTREAM_CUDA_GRAPHS=0 for the scope of one run (the A/B switch of
// worker/train/micro_batch_runner.h), restored after.
class EagerOnly {
 public:
  EagerOnly() { setenv("LORASTREAM_CUDA_GRAPHS", "0", 1); }
  ~EagerOnly() { unsetenv("LORASTREAM_CUDA_GRAPHS"); }
};

struct TrainedRun {
  TrainResult result;
  std::vector<StepStats> steps;
};

// A tiny checkpoint and `documents` JSONL documents in a fresh temporary folder.
struct TinyModelAndData {
  TinyModelAndData(const std::string& name, int documents)
      : dir(name),
        model(MakeCheckpoint(dir / "model", "tiny")),
        data(WriteJsonl(dir / "d.jsonl", documents, 40, 80, 512)) {}
  JobSpec Job(const std::string& out) const { return TinyJob(model, data, dir / out); }
  TempDir dir;
  std::string model, data;
};

TrainedRun Train(const JobSpec& spec, bool streamed) {
  TrainedRun r;
  r.result = RunTraining(spec, CudaTrainOptions(streamed),
                         [&](const StepStats& s) { r.steps.push_back(s); });
  return r;
}

}  // namespace

namespace {

// `spec` trained resident with CUDA graphs and again eagerly (into `eager_dir`): the first
// micro-batch runs eagerly, the second is captured and every later one replayed; every step's
// loss and gradient norm and the final adapter are the same bits, and a replay's memory is
// reported (the allocator sees none of it).
void CheckGraphedEqualsEager(const JobSpec& spec, const std::string& model,
                             const std::string& eager_dir) {
  const TrainedRun graphed = Train(spec, /*streamed=*/false);
  CHECK(graphed.result.graphed_micro_batches == spec.train.steps * spec.train.grad_accum - 1);
  JobSpec eager_spec = spec;
  eager_spec.train.output_dir = eager_dir;
  TrainedRun eager;
  {
    EagerOnly off;
    eager = Train(eager_spec, /*streamed=*/false);
  }
  CHECK(eager.result.graphed_micro_batches == 0);
  REQUIRE(graphed.steps.size() == eager.steps.size());
  for (size_t i = 0; i < eager.steps.size(); ++i) {
    CAPTURE(i);
    CHECK(graphed.steps[i].loss == eager.steps[i].loss);
    CHECK(graphed.steps[i].grad_norm == eager.steps[i].grad_norm);
    CHECK(graphed.steps[i].peak_device_bytes > 0);
  }
  const c10::Device cuda("cuda:0");
  const ModelConfig config = LoadModelConfig(model + "/config.json");
  const auto pa = LoraAdapter::Load(spec.train.output_dir, config, cuda).Params();
  const auto pb = LoraAdapter::Load(eager_spec.train.output_dir, config, cuda).Params();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) CHECK(at::equal(pa[i], pb[i]));
}

}  // namespace

TEST_CASE("CUDA: a resident job replays its micro-batches from a CUDA graph, equal to eager",
          "[gpu]") {
  const TinyModelAndData tiny("cuda-graphs", 24);
  JobSpec spec = tiny.Job("graphed");
  spec.train.steps = 5;
  spec.train.grad_accum = 2;  // replays accumulate into the gradients, zeroed in place
  spec.train.checkpoint_every = 2;
  spec.optim.grad_clip = 0.5;  // the clip reads the graph's gradients
  CheckGraphedEqualsEager(spec, tiny.model, tiny.dir / "eager");
}

TEST_CASE("CUDA: a mixture-of-experts job in bf16 replays from a CUDA graph, equal to eager",
          "[gpu]") {
  // The grouped expert GEMMs never wait for the device, so the step can be captured (rank 4:
  // padded to 8 inside the grouped GEMMs); in f32 (per-expert GEMMs, which read the routing
  // on the host) it runs eagerly.
  TempDir dir("cuda-moe-graphs");
  const std::string model = MakeCheckpoint(dir / "model", "tiny-moe");
  const std::string data = WriteJsonl(dir / "d.jsonl", 24, 40, 80, 512);
  JobSpec spec = TinyJob(model, data, dir / "graphed");
  spec.train.steps = 4;
  spec.train.grad_accum = 2;
  spec.train.dtype = "bf16";
  spec.optim.grad_clip = 0.5;
  CheckGraphedEqualsEager(spec, model, dir / "eager");

  JobSpec f32 = spec;
  f32.train.dtype = "f32";
  f32.train.output_dir = dir / "f32";
  CHECK(Train(f32, /*streamed=*/false).result.graphed_micro_batches == 0);
}

TEST_CASE("CUDA: streamed jobs and jobs with LoRA dropout run their micro-batches eagerly",
          "[gpu]") {
  const TinyModelAndData tiny("cuda-graphs-eager", 16);
  JobSpec streamed = tiny.Job("streamed");
  streamed.stream.blocks_to_swap = 1;
  CHECK(Train(streamed, /*streamed=*/true).result.graphed_micro_batches == 0);
  JobSpec dropout = tiny.Job("dropout");
  dropout.lora.dropout = 0.1;  // its masks are seeded from the host at every micro-batch
  CHECK(Train(dropout, /*streamed=*/false).result.graphed_micro_batches == 0);
  // The same job through the stream provider with nothing streamed is graphed.
  JobSpec resident = tiny.Job("resident");
  CHECK(Train(resident, /*streamed=*/true).result.graphed_micro_batches ==
        resident.train.steps - 1);
}

TEST_CASE("CUDA: graphed jobs one after another in one process leave no memory behind", "[gpu]") {
  // A worker trains job after job in one process: each job's graph, its pool and its capture
  // stream's state must not accumulate (cuBLAS keeps a workspace per stream for the process).
  const TinyModelAndData tiny("cuda-graphs-repeat", 16);
  std::vector<uint64_t> after;
  for (int job = 0; job < 3; ++job) {
    JobSpec spec = tiny.Job("out" + std::to_string(job));
    CHECK(Train(spec, /*streamed=*/false).result.graphed_micro_batches == spec.train.steps - 1);
    after.push_back(CudaAllocatedBytes(0));
  }
  CAPTURE(after);
  CHECK(after[1] == after[0]);
  CHECK(after[2] == after[0]);
}
