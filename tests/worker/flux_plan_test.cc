// The FLUX planner (torch-free): units of two sizes at FLUX.1-dev's shape in bf16, figures
// shaped like an H200's. The chosen plan fits the budget and no plan that fits is predicted
// faster; a ring's slot is the largest streamed unit; the resident step is the units' costs
// scaled by kind; a budget below the smallest plan is refused naming the key.
#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/flux_config.h"
#include "common/formats/manifest.h"
#include "worker/flux/flux_plan.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;

namespace {

FluxMemoryInputs DevInputs() {
  FluxMemoryInputs in;
  in.config = FluxConfig{};  // FLUX.1-dev
  in.units = FluxUnits(in.config, 2);
  for (const auto& u : in.units)
    in.unit_bytes.push_back(
        LayoutSegment(FluxUnitShapes(in.config, u), "unit", DType::kBF16, 256).nbytes);
  for (const auto& [name, shape] : FluxRestShapes(in.config)) {
    uint64_t n = 2;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    in.rest_bytes += n;
  }
  in.lora_params = 77'000'000;
  in.image_tokens = 4096;
  in.text_tokens = 512;
  return in;
}

StepCosts H200Costs(const FluxMemoryInputs& in) {
  StepCosts c;
  c.block_forward_seconds = 0.005;
  c.block_backward_seconds = 0.015;
  c.tail_seconds = 0.004;
  c.h2d_bytes_per_second = 55e9;
  c.block_scale = FluxBlockScale(in, 0.42);
  return c;
}

}  // namespace

TEST_CASE("flux planner: the fastest plan that fits, slots sized by the streamed kinds",
          "[worker_core][flux]") {
  const FluxMemoryInputs in = DevInputs();
  REQUIRE(in.units.size() == 38);
  const uint64_t dbl = in.unit_bytes.front(), sgl = in.unit_bytes.back();
  CHECK(dbl > sgl);
  CHECK(dbl / double(1 << 20) == Approx(648).margin(2));
  CHECK(sgl / double(1 << 20) == Approx(540).margin(2));

  // Slots: streaming only single units makes a slot a single unit's size.
  CHECK(EstimateFluxMemory(in, FluxResidency(in, 0, 5, 2)).slot == sgl);
  CHECK(EstimateFluxMemory(in, FluxResidency(in, 1, 5, 2)).slot == dbl);
  const auto all = EstimateFluxMemory(in, FluxResidency(in, 19, 19, 2));
  CHECK(all.ring == 2 * dbl);
  CHECK(all.resident == 0);
  CHECK(EstimateFluxMemory(in, FluxResidency(in, 0, 0, 2)).resident > 22ull << 30);  // 23.7 GB

  const StepCosts costs = H200Costs(in);
  const uint64_t budget = uint64_t{8} << 30;
  const PlanChoice choice = ChooseFluxPlan(in, costs, budget);
  REQUIRE(choice.chosen >= 0);
  const CandidatePlan& chosen = choice.candidates[choice.chosen];
  CHECK(chosen.fits);
  CHECK(chosen.peak_bytes <= budget);
  CHECK(chosen.plan.num_streamed() > 0);
  for (const auto& c : choice.candidates) CHECK((c.peak_bytes <= budget) == c.fits);
  // No hand-picked split or ring that fits is predicted faster.
  for (int d = 0; d <= 19; ++d)
    for (int s = 0; s <= 19; ++s)
      for (int ring = 1; ring <= 3 && ring <= std::max(1, d + s); ++ring) {
        const ResidencyPlan p = FluxResidency(in, d, s, ring);
        if (EstimateFluxMemory(in, p).total() > budget) continue;
        INFO("double " << d << " single " << s << " ring " << ring);
        CHECK(PredictStep(p, in.unit_bytes, costs).step_seconds >=
              chosen.predicted.step_seconds * (1 - kPlanTieFraction));
      }

  // The resident step: every unit's forward and recompute+backward by its scale, the tail.
  const ResidencyPlan resident = FluxResidency(in, 0, 0, 1);
  double expected = costs.tail_seconds;
  for (double s : costs.block_scale)
    expected += s * (costs.block_forward_seconds + costs.block_backward_seconds);
  CHECK(PredictStep(resident, in.unit_bytes, costs).step_seconds == Approx(expected));
  const PlanChoice roomy = ChooseFluxPlan(in, costs, uint64_t{200} << 30);
  CHECK(roomy.candidates[roomy.chosen].plan.num_streamed() == 0);

  try {
    ChooseFluxPlan(in, costs, uint64_t{1} << 30);
    FAIL("a 1 GiB budget was accepted");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("flux.gpu_memory_budget"));
  }
}
