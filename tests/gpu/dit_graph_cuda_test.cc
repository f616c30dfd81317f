// Diffusion steps from CUDA graphs (worker/train/graphed_call.h): a resident FLUX.1 job on
// CUDA replays its group step from one graph from its second step on, and trains exactly as
// eagerly (LORASTREAM_CUDA_GRAPHS=0): the same losses and gradient norms, bit for bit. A job
// whose buckets differ drops the graph at the first other shape and goes on eagerly, still
// equal to eager; a streamed job never graphs; a resident group of two of one shape (stacked)
// replays its steps from one graph, equal to its eager run.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/job/flux_job.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "worker/flux/flux_group.h"
#include "worker/flux/flux_train.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;

namespace {

// LORASTREAM_CUDA_GRAPHS=0 for the scope of one run, restored after.
class EagerOnly {
 public:
  EagerOnly() { setenv("LORASTREAM_CUDA_GRAPHS", "0", 1); }
  ~EagerOnly() { unsetenv("LORASTREAM_CUDA_GRAPHS"); }
};

FluxJob TinyJob(const std::string& checkpoint, const std::string& cache_dir) {
  FluxJob j;
  j.checkpoint = checkpoint;
  j.cache_dir = cache_dir;
  j.steps = 5;
  j.rank = 4;
  j.alpha = 4;
  j.learning_rate = 1e-3;
  j.blocks_to_swap = 0;
  return j;
}

void CheckSameSteps(const std::vector<StepStats>& graphed, const std::vector<StepStats>& eager) {
  REQUIRE(graphed.size() == eager.size());
  for (size_t i = 0; i < eager.size(); ++i) {
    CAPTURE(i);
    CHECK(std::isfinite(eager[i].loss));
    CHECK(graphed[i].loss == eager[i].loss);
    CHECK(graphed[i].grad_norm == eager[i].grad_norm);
    CHECK(graphed[i].peak_device_bytes > 0);
  }
}

// The job graphed (the default) and eagerly, each in its own output folder.
std::pair<FluxTrainResult, FluxTrainResult> GraphedAndEager(FluxJob job, const std::string& dir) {
  FluxTrainOptions options;
  options.device = "cuda";
  job.output_dir = dir + "/graphed";
  FluxTrainResult graphed = TrainFlux(job, options);
  job.output_dir = dir + "/eager";
  const EagerOnly off;
  return {std::move(graphed), TrainFlux(job, options)};
}

}  // namespace

TEST_CASE("CUDA: a resident FLUX job replays its steps from a CUDA graph, equal to eager",
          "[gpu]") {
  testing::TempDir dir("cuda-flux-graphs");
  const std::string checkpoint = testing::MakeFluxCheckpoint(dir.str() + "/model");
  const std::string one_bucket = dir.str() + "/one-bucket";
  std::filesystem::create_directories(one_bucket);
  for (uint64_t k = 0; k < 3; ++k)
    testing::WriteFluxCache(one_bucket, "img" + std::to_string(k), 32, 48,
                            testing::TinyCacheShape(), 40 + k);
  const auto [graphed, eager] =
      GraphedAndEager(TinyJob(checkpoint, one_bucket), dir.str() + "/one");
  CHECK(graphed.graphed_steps == 4);  // the first step runs eagerly, the second is captured
  CHECK(eager.graphed_steps == 0);
  CheckSameSteps(graphed.steps, eager.steps);

  SECTION("buckets of two shapes: the graph is dropped at the first other shape") {
    FluxJob job =
        TinyJob(checkpoint, std::string(LORASTREAM_SOURCE_DIR) + "/configs/data/flux-tiny");
    job.steps = 8;
    const auto [g, e] = GraphedAndEager(job, dir.str() + "/buckets");
    CHECK(g.graphed_steps < job.steps - 1);
    CHECK(e.graphed_steps == 0);
    CheckSameSteps(g.steps, e.steps);
  }
  SECTION("a streamed job runs eagerly") {
    FluxJob job = TinyJob(checkpoint, one_bucket);
    job.blocks_to_swap = 3;
    job.ring_size = 1;
    FluxTrainOptions options;
    options.device = "cuda";
    job.output_dir = dir.str() + "/streamed";
    CHECK(TrainFlux(job, options).graphed_steps == 0);
  }
  SECTION("a resident group of two of one shape replays one graph, equal to eager") {
    FluxJob a = TinyJob(checkpoint, one_bucket);
    FluxJob b = a;
    b.seed = 9;
    b.learning_rate = 2e-3;
    std::map<std::string, std::map<bool, std::vector<StepStats>>> steps;
    for (const bool eager_run : {false, true}) {
      std::vector<GroupJob> jobs;
      for (const auto& [name, job] :
           {std::pair{std::string("a"), a}, std::pair{std::string("b"), b}}) {
        FluxJob j = job;
        j.output_dir = dir.str() + "/group-" + name + (eager_run ? "-eager" : "-graphed");
        GroupJob g;
        g.spec = FluxJobSpec(j, name);
        g.on_step = [&steps, name = name, eager_run](const StepStats& s) {
          steps[name][eager_run].push_back(s);
        };
        jobs.push_back(std::move(g));
      }
      FluxTrainOptions options;
      options.device = "cuda";
      std::unique_ptr<EagerOnly> off;
      if (eager_run) off = std::make_unique<EagerOnly>();
      for (const GroupJobOutcome& out : RunFluxGroupTraining(std::move(jobs), options)) {
        INFO(out.name);
        CHECK(!out.error);
        if (!eager_run) CHECK(out.result.graphed_micro_batches == a.steps - 1);
      }
    }
    for (const std::string name : {"a", "b"}) {
      CAPTURE(name);
      CheckSameSteps(steps[name][false], steps[name][true]);
    }
  }
}
