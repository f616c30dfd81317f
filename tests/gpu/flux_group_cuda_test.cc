// FLUX.1 job groups on CUDA: two flux-tiny jobs of different shapes (rank, targets, batch,
// seed, steps), and two of one shape (stacked into one batch where their buckets agree),
// trained as one streamed group give each job's losses alone (f32, within f32 rounding), and
// the group's steps copy what one job's steps copy.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/job/flux_job.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "worker/flux/flux_group.h"
#include "worker/flux/flux_train.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;

TEST_CASE("CUDA: FLUX jobs in a streamed group train as each alone, with one job's copies",
          "[gpu]") {
  testing::TempDir dir("cuda-flux-group");
  FluxJob a;
  a.checkpoint = testing::MakeFluxCheckpoint(dir.str() + "/model");
  a.cache_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/data/flux-tiny";
  a.steps = 4;
  a.rank = 4;
  a.alpha = 4;
  a.learning_rate = 1e-3;
  a.blocks_to_swap = 3;
  a.ring_size = 1;
  FluxJob b = a;
  b.steps = 2;
  b.rank = 8;
  b.targets = {"attention"};
  b.seed = 5;
  b.batch_size = 2;
  // c: a's shape and adapter settings, another seed and learning rate: a and c run stacked
  // (one batch through each unit) at the steps where their buckets agree.
  FluxJob c = a;
  c.seed = 9;
  c.learning_rate = 2e-3;
  FluxTrainOptions options;
  options.device = "cuda";
  std::map<std::string, std::vector<StepStats>> alone;
  for (const auto& [name, job] : {std::pair{std::string("a"), a}, std::pair{std::string("b"), b},
                                  std::pair{std::string("c"), c}}) {
    FluxJob j = job;
    j.output_dir = dir.str() + "/alone-" + name;
    alone[name] = TrainFlux(j, options).steps;
  }
  for (const std::string second : {"b", "c"}) {
    CAPTURE(second);
    std::map<std::string, std::vector<StepStats>> grouped;
    std::vector<GroupJob> jobs;
    for (const auto& [name, job] :
         {std::pair{std::string("a"), a}, std::pair{second, second == "b" ? b : c}}) {
      FluxJob j = job;
      j.output_dir = dir.str() + "/group-" + second + "-" + name;
      GroupJob g;
      g.spec = FluxJobSpec(j, name);
      g.on_step = [&grouped, name = name](const StepStats& s) { grouped[name].push_back(s); };
      jobs.push_back(std::move(g));
    }
    for (const GroupJobOutcome& out : RunFluxGroupTraining(std::move(jobs), options)) {
      INFO(out.name);
      CHECK(!out.error);
    }
    for (const std::string& name : {std::string("a"), second}) {
      CAPTURE(name);
      REQUIRE(grouped[name].size() == alone[name].size());
      for (size_t i = 0; i < alone[name].size(); ++i) {
        CAPTURE(i);
        CHECK(std::isfinite(grouped[name][i].loss));
        CHECK(grouped[name][i].loss == Approx(alone[name][i].loss).epsilon(1e-5));
      }
    }
    for (size_t i = 0; i < grouped["a"].size(); ++i) {
      CAPTURE(i);
      CHECK(grouped["a"][i].h2d_bytes > 0);
      CHECK(grouped["a"][i].h2d_bytes == alone["a"][i].h2d_bytes);
    }
  }
}
