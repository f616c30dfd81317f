// FLUX.1 on CUDA from a store: flux-tiny served in bf16, a job naming the store streams its
// units from the read-only shared mapping (registered with CUDA read-only, or staged) and
// trains as the same job on the checkpoint does, within bf16 rounding.
#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/job/flux_job.h"
#include "store/server.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "worker/flux/flux_train.h"

using namespace lorastream;
using namespace lorastream::worker::flux;

TEST_CASE("CUDA: a FLUX job on a bf16 store trains as the same job on its checkpoint", "[gpu]") {
  testing::TempDir dir("cuda-flux-store");
  store::ServeOptions serve;
  serve.model_dir = testing::MakeFluxCheckpoint(dir.str() + "/model", "bf16");
  serve.name = "test-cuda-flux-" + std::to_string(::getpid());
  serve.lock = false;
  const auto published = store::PublishedStore::Build(serve);

  FluxJob job;
  job.cache_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/data/flux-tiny";
  job.steps = 3;
  job.rank = 4;
  job.alpha = 4;
  job.learning_rate = 1e-3;
  job.dtype = "bf16";
  job.blocks_to_swap = 3;
  job.ring_size = 1;
  FluxTrainOptions options;
  options.device = "cuda";
  std::vector<StepStats> runs[2];
  for (int from_store = 0; from_store < 2; ++from_store) {
    CAPTURE(from_store);
    FluxJob j = job;
    (from_store ? j.store : j.checkpoint) = from_store ? serve.name : serve.model_dir;
    j.output_dir = dir.str() + (from_store ? "/out-store" : "/out-checkpoint");
    runs[from_store] = TrainFlux(j, options).steps;
    REQUIRE(runs[from_store].size() == 3);
    for (const StepStats& s : runs[from_store]) {
      CHECK(std::isfinite(s.loss));
      CHECK(s.h2d_bytes > 0);
      CHECK(s.peak_device_bytes > 0);
    }
  }
  for (size_t i = 0; i < runs[0].size(); ++i)
    CHECK(runs[1][i].loss == Approx(runs[0][i].loss).epsilon(2e-2));
}
