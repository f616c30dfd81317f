// Taped units in the DiT planner (torch-free), at FLUX.1-dev's and Qwen-Image's shapes in
// bf16: a taped unit's term is dit_plan.h's formula (written out here from the widths) and
// grows with the tokens; only resident units are taped, the last ones in forward order; the
// planner tapes units when the budget leaves room and none when it does not, every plan with
// taped units fits its budget in the estimate and is predicted a forward faster per unit;
// a compressed store's units and a plan without a budget are never taped. With the fused q, k,
// v kernel the estimate keeps no f32 copies of q and k; PlanDitUnits measures what it needs.
#include <catch2/catch.hpp>

#include "common/formats/flux_config.h"
#include "common/formats/manifest.h"
#include "common/formats/qwen_image_config.h"
#include "worker/flux/flux_plan.h"
#include "worker/qwen_image/qwen_image_plan.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

flux::FluxMemoryInputs FluxDev(int64_t image_tokens = 4096) {
  flux::FluxMemoryInputs in;
  in.config = FluxConfig{};  // FLUX.1-dev
  in.units = FluxUnits(in.config, 2);
  for (const auto& u : in.units)
    in.unit_bytes.push_back(
        LayoutSegment(FluxUnitShapes(in.config, u), "unit", DType::kBF16, 256).nbytes);
  in.rest_bytes = uint64_t{1} << 30;
  in.lora_params = 77'000'000;
  in.lora_rank = 16;
  in.image_tokens = image_tokens;
  in.text_tokens = 512;
  return in;
}

qwen_image::QwenImageMemoryInputs QwenDev() {
  qwen_image::QwenImageMemoryInputs in;
  in.config = QwenImageConfig{};
  for (int64_t i = 0; i < in.config.num_layers; ++i)
    in.block_bytes.push_back(
        LayoutSegment(QwenImageUnitShapes(in.config, i), "unit", DType::kBF16, 256).nbytes);
  in.rest_bytes = uint64_t{1} << 30;
  in.job = {"a", 200'000'000, 1, 4096, 256, 16};
  return in;
}

StepCosts Costs(double h2d_bytes_per_second) {
  StepCosts c;
  c.block_forward_seconds = 0.012;
  c.block_backward_seconds = 0.036;
  c.tail_seconds = 0.02;
  c.h2d_bytes_per_second = h2d_bytes_per_second;
  return c;
}

}  // namespace

TEST_CASE("dit taped units: the estimate's term is the formula's and grows with the tokens",
          "[worker_core][dit]") {
  const flux::FluxMemoryInputs in = FluxDev();
  const DitMemoryModel m = flux::FluxMemoryModel(in);
  const uint64_t h = 3072, mlp = 12288, b = 2, heads = 24, rank = 16;
  const uint64_t t = 4096 + 512;  // B = 1
  REQUIRE(in.config.hidden_size == 3072);
  REQUIRE(in.config.mlp_hidden == 12288);
  REQUIRE(in.config.num_heads == 24);
  // Per token: a double block's 16H + 2M kept values, 32H of f32 q and k, the log-sum-exp,
  // two LayerNorms' statistics and 4 LoRA A x; a single block's 13H + 3M, 32H, the
  // log-sum-exp, one LayerNorm's statistics and 2 LoRA A x.
  const uint64_t dbl = b * (16 * h + 2 * mlp) + 32 * h + 4 * heads + 16 + 4 * rank * b;
  const uint64_t sgl = b * (13 * h + 3 * mlp) + 32 * h + 4 * heads + 8 + 2 * rank * b;

  const ResidencyPlan untaped = flux::FluxResidency(in, 0, 0, 1);
  const DitMemoryEstimate none = flux::EstimateFluxMemory(in, untaped);
  CHECK(none.tapes == 0);
  CHECK(none.taped == 0);
  // The last unit (of two single blocks) taped.
  ResidencyPlan one = untaped;
  one.taped_blocks = 1;
  const DitMemoryEstimate e1 = flux::EstimateFluxMemory(in, one);
  CHECK(e1.taped == 1);
  CHECK(e1.tapes == t * 2 * sgl);
  CHECK(e1.first_backward == e1.tapes);  // the first unit of the backward
  CHECK(e1.forward() == none.forward() + e1.tapes);
  CHECK(e1.backward() == none.backward());
  // Every single unit streamed: the last resident unit is the last double block.
  ResidencyPlan doubles = flux::FluxResidency(in, 0, 19, 1);
  doubles.taped_blocks = 2;
  const std::vector<bool> taped = TapedBlocks(doubles);
  for (int u = 0; u < doubles.num_blocks(); ++u) CHECK(taped[u] == (u == 17 || u == 18));
  const DitMemoryEstimate e2 = flux::EstimateFluxMemory(in, doubles);
  CHECK(e2.tapes == 2 * t * dbl);
  CHECK(e2.first_backward == 0);  // the backward's first unit is streamed: every tape lives
  CHECK(e2.backward() ==
        flux::EstimateFluxMemory(in, flux::FluxResidency(in, 0, 19, 1)).backward() + e2.tapes);
  // Linear in the tokens (fused attention); a second job adds its own tapes.
  const DitMemoryEstimate small = flux::EstimateFluxMemory(FluxDev(1024), one);
  CHECK(small.tapes == (1024 + 512) * 2 * sgl);
  CHECK(small.tapes < e1.tapes);
  flux::FluxMemoryInputs group = in;
  group.group.push_back(flux::FluxDitJob(FluxDev(1024), "b"));
  CHECK(flux::EstimateFluxMemory(group, one).tapes == e1.tapes + small.tapes);

  // Qwen-Image: 6 token-wise linears a block.
  const qwen_image::QwenImageMemoryInputs q = QwenDev();
  const uint64_t d = 3072, qm = 12288, qheads = 24;
  REQUIRE(q.config.hidden() == 3072);
  REQUIRE(q.config.mlp_hidden() == 12288);
  REQUIRE(q.config.num_heads == 24);
  ResidencyPlan qp = DitResidency(qwen_image::QwenImageMemoryModel(q), {0}, 1, 3);
  CHECK(qwen_image::EstimateQwenImageMemory(q, qp).tapes ==
        3 * (4096 + 256) * (b * (16 * d + 2 * qm) + 32 * d + 4 * qheads + 16 + 6 * rank * b));
  (void)m;
}

TEST_CASE(
    "dit taped units: the planner tapes the last resident units when the budget allows, none "
    "when it does not; the plan fits and saves a forward per taped unit",
    "[worker_core][dit]") {
  const qwen_image::QwenImageMemoryInputs q = QwenDev();
  const DitMemoryModel m = qwen_image::QwenImageMemoryModel(q);
  const ResidencyPlan resident = DitResidency(m, {0}, 1);
  const DitMemoryEstimate base = EstimateDitMemory(m, q.job, {}, resident);
  ResidencyPlan one = resident;
  one.taped_blocks = 1;
  const uint64_t tape = EstimateDitMemory(m, q.job, {}, one).tapes;
  REQUIRE(tape > 0);
  // A slow link: streaming costs more than any tape saves, so the resident plan is chosen.
  const StepCosts slow = Costs(1e8);

  // Room for the resident plan but not for one tape (it adds to the forward phase): none taped.
  REQUIRE(base.forward() + tape > base.total());
  const PlanChoice tight = qwen_image::ChooseQwenImagePlan(q, slow, base.forward() + tape - 1);
  const CandidatePlan& t0 = tight.candidates[tight.chosen];
  CHECK(t0.plan.num_streamed() == 0);
  CHECK(t0.plan.taped_blocks == 0);

  // Room for three and a half tapes beyond the forward: three taped, the last three blocks.
  const uint64_t budget = base.forward() + 3 * tape + tape / 2;
  REQUIRE(budget >= base.total());
  const PlanChoice roomy = qwen_image::ChooseQwenImagePlan(q, slow, budget);
  const CandidatePlan& c = roomy.candidates[roomy.chosen];
  CHECK(c.plan.num_streamed() == 0);
  CHECK(c.plan.taped_blocks == 3);
  const std::vector<bool> taped = TapedBlocks(c.plan);
  for (int u = 0; u < c.plan.num_blocks(); ++u) CHECK(taped[u] == (u >= c.plan.num_blocks() - 3));
  CHECK(c.peak_bytes <= budget);
  CHECK(EstimateDitMemory(m, q.job, {}, c.plan).total() == c.peak_bytes);
  // Each taped block's backward skips its recompute: the calibrated forward.
  const double untaped = PredictStep(resident, m.unit_bytes, slow).step_seconds;
  CHECK(c.predicted.step_seconds == Approx(untaped - 3 * slow.block_forward_seconds));
  CHECK(DescribeDitPlanning(m, q.job, {}, roomy, slow, budget).find("taped=3") !=
        std::string::npos);

  // Without a budget the job's plan is kept as it is: nothing taped.
  const PlanChoice hand = PlanDitJob(m, q.job, {}, slow, 0, resident);
  CHECK(hand.candidates[hand.chosen].plan.taped_blocks == 0);

  // A compressed store's units share one expansion scratch: never taped.
  qwen_image::QwenImageMemoryInputs packed = q;
  packed.expanded_bytes = q.block_bytes;
  const PlanChoice compressed = qwen_image::ChooseQwenImagePlan(packed, slow, uint64_t{1} << 50);
  for (const CandidatePlan& k : compressed.candidates) CHECK(k.plan.taped_blocks == 0);
}

TEST_CASE(
    "dit taped units: under any budget every taped unit is resident and every candidate "
    "fits its budget in the estimate (FLUX.1, alone and in a group)",
    "[worker_core][dit]") {
  flux::FluxMemoryInputs in = FluxDev();
  StepCosts costs = Costs(55e9);
  costs.block_scale = flux::FluxBlockScale(in, 0.42);
  int plans_taped = 0;
  for (int with_group = 0; with_group < 2; ++with_group) {
    if (with_group) in.group.push_back(flux::FluxDitJob(FluxDev(1024), "b"));
    const DitMemoryModel m = flux::FluxMemoryModel(in);
    const uint64_t minimum =
        flux::EstimateFluxMemory(in, DitSmallestPlan(m)).total() + (uint64_t{1} << 30);
    for (uint64_t budget = minimum; budget <= uint64_t{96} << 30; budget += uint64_t{6} << 30) {
      INFO("budget " << budget << (with_group ? " (group)" : ""));
      const PlanChoice choice = flux::ChooseFluxPlan(in, costs, budget);
      for (const CandidatePlan& c : choice.candidates) {
        if (c.plan.taped_blocks == 0) continue;
        CHECK(c.fits);
        CHECK(flux::EstimateFluxMemory(in, c.plan).total() <= budget);
        const std::vector<bool> taped = TapedBlocks(c.plan);
        int count = 0;
        for (int u = 0; u < c.plan.num_blocks(); ++u) {
          if (!taped[u]) continue;
          CHECK(!c.plan.streamed[u]);
          ++count;
        }
        CHECK(count == c.plan.taped_blocks);
        // The most that fit: one more does not.
        ResidencyPlan more = c.plan;
        ++more.taped_blocks;
        if (more.taped_blocks <= more.num_blocks() - more.num_streamed())
          CHECK(flux::EstimateFluxMemory(in, more).total() > budget);
      }
      if (choice.candidates[choice.chosen].plan.taped_blocks > 0) ++plans_taped;
    }
  }
  CHECK(plans_taped > 0);  // some budget leaves the chosen plan room for tapes
}

TEST_CASE(
    "dit taped units: stream.taped_blocks as the LLMs read it (N: the last N resident units, "
    "-1: as many as fit, 0: the plan's; below -1 refused naming the key)",
    "[worker_core][dit]") {
  const qwen_image::QwenImageMemoryInputs q = QwenDev();
  const DitMemoryModel m = qwen_image::QwenImageMemoryModel(q);
  const StepCosts costs = Costs(25e9);
  const ResidencyPlan hand = DitResidency(m, {40}, 2);  // 20 resident blocks
  // N: the last N resident blocks, at most every resident one; nothing else changes.
  const ResidencyPlan five = PlanDitJob(m, q.job, {}, costs, 0, hand, 5).candidates[0].plan;
  CHECK(five.taped_blocks == 5);
  CHECK(five.streamed == hand.streamed);
  const std::vector<bool> taped = TapedBlocks(five);
  int last_resident_taped = 0;
  for (int u = five.num_blocks() - 1, seen = 0; u >= 0 && seen < 5; --u)
    if (!five.streamed[u]) {
      last_resident_taped += taped[u] ? 1 : 0;
      ++seen;
    }
  CHECK(last_resident_taped == 5);
  CHECK(PlanDitJob(m, q.job, {}, costs, 0, hand, 100).candidates[0].plan.taped_blocks == 20);
  CHECK(PlanDitJob(m, q.job, {}, costs, 0, hand, 0).candidates[0].plan.taped_blocks == 0);
  // -1 without a budget: as many as fit the plan's own estimated peak.
  const uint64_t peak = EstimateDitMemory(m, q.job, {}, hand).total();
  const CandidatePlan filled = PlanDitJob(m, q.job, {}, costs, 0, hand, -1).candidates[0];
  CHECK(filled.peak_bytes <= peak);
  ResidencyPlan more = filled.plan;
  ++more.taped_blocks;
  if (filled.plan.taped_blocks < 20) CHECK(EstimateDitMemory(m, q.job, {}, more).total() > peak);
  // -1 within a budget: the most that fit it.
  const uint64_t budget = uint64_t{60} << 30;
  const PlanChoice within = PlanDitJob(m, q.job, {}, costs, budget, hand, -1);
  const CandidatePlan& w = within.candidates[within.chosen];
  CHECK(w.peak_bytes <= budget);
  CHECK(w.plan.taped_blocks > 0);
  try {
    PlanDitJob(m, q.job, {}, costs, 0, hand, -2);
    FAIL("taped_blocks -2 was accepted");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("stream.taped_blocks") != std::string::npos);
  }
}

TEST_CASE(
    "dit estimate with the fused q, k, v kernel: no f32 copies of q and k, two H fewer kept a "
    "taped block, the same otherwise",
    "[worker_core][dit]") {
  flux::FluxMemoryInputs in = FluxDev();
  const uint64_t h = 3072, mlp = 12288, b = 2, heads = 24, rank = 16, t = 4096 + 512;
  flux::FluxMemoryInputs fused = in;
  fused.fused_heads = true;
  ResidencyPlan plan = flux::FluxResidency(in, 0, 0, 1);
  plan.taped_blocks = 1;  // the last unit: two single blocks
  const DitMemoryEstimate plain = flux::EstimateFluxMemory(in, plan);
  const DitMemoryEstimate e = flux::EstimateFluxMemory(fused, plan);
  CHECK(e.tapes == t * 2 * (b * (11 * h + 3 * mlp) + 4 * heads + 8 + 2 * rank * b));
  CHECK(plain.tapes - e.tapes == t * 2 * (b * 2 * h + 32 * h));
  CHECK(plain.forward_working - e.forward_working == t * 32 * h);
  CHECK(plain.backward_working - e.backward_working == 2 * t * 32 * h);  // a unit of two blocks
  CHECK(e.resident == plain.resident);
  CHECK(e.adapter == plain.adapter);
  CHECK(e.checkpoints == plain.checkpoints);
  // Qwen-Image's dual-stream blocks: 14H + 2M kept.
  qwen_image::QwenImageMemoryInputs q = QwenDev();
  q.fused_heads = true;
  const ResidencyPlan qp = DitResidency(qwen_image::QwenImageMemoryModel(q), {0}, 1, 3);
  CHECK(qwen_image::EstimateQwenImageMemory(q, qp).tapes ==
        3 * (4096 + 256) * (b * (14 * h + 2 * mlp) + 4 * heads + 16 + 6 * rank * b));
}

TEST_CASE(
    "PlanDitUnits: the job file's plan without a budget, measured only when planning; a stacked "
    "group measured as one batch, another group job by job",
    "[worker_core][dit]") {
  const qwen_image::QwenImageMemoryInputs q = QwenDev();
  const DitMemoryModel m = qwen_image::QwenImageMemoryModel(q);
  const ResidencyPlan hand = DitResidency(m, {40}, 2);
  int inputs_asked = 0, members_asked = 0;
  std::vector<int64_t> batches;
  auto run = [&](uint64_t budget, bool predict, int64_t taped, const std::vector<DitJob>& group,
                 bool stacked) {
    inputs_asked = members_asked = 0;
    batches.clear();
    return PlanDitUnits(
        budget, predict, hand, taped,
        [&] {
          ++inputs_asked;
          DitPlanInputs in{m, q.job, group};
          in.model.group_stacked = stacked;
          return in;
        },
        [&](int64_t k) {
          batches.push_back(k);
          StepCosts c = Costs(25e9);
          c.block_backward_seconds *= static_cast<double>(k);
          return c;
        },
        [&] {
          ++members_asked;
          return std::vector<StepCosts>(group.size(), Costs(25e9));
        });
  };
  // No budget, not predicting: the hand plan, nothing asked or measured.
  DitPlanning p = run(0, false, 0, {}, false);
  CHECK(p.plan.streamed == hand.streamed);
  CHECK(p.choice.candidates.empty());
  CHECK(inputs_asked == 0);
  CHECK(batches.empty());
  // ... with taped units: the inputs asked for the estimate, still nothing measured.
  p = run(0, false, 5, {}, false);
  CHECK(p.plan.taped_blocks == 5);
  CHECK(inputs_asked == 1);
  CHECK(batches.empty());
  // Predicting without a budget: the hand plan as the one candidate, measured once.
  p = run(0, true, 0, {}, false);
  REQUIRE(p.choice.candidates.size() == 1);
  CHECK(p.plan.streamed == hand.streamed);
  CHECK(batches == std::vector<int64_t>{1});
  // A group of three of one shape that stacks: the job, then every job's samples as one batch.
  const std::vector<DitJob> two{q.job, q.job};
  const uint64_t budget = uint64_t{40} << 30;
  p = run(budget, false, 0, two, true);
  CHECK(batches == std::vector<int64_t>{1, 3});
  CHECK(members_asked == 0);
  CHECK(p.costs.block_backward_seconds == Approx(Costs(25e9).block_backward_seconds * 3));
  CHECK(p.choice.candidates[p.choice.chosen].peak_bytes <= budget);
  // The same group unstacked: the job, then each other job alone (every job's compute).
  p = run(budget, false, 0, two, false);
  CHECK(batches == std::vector<int64_t>{1});
  CHECK(members_asked == 1);
  CHECK(p.costs.block_backward_seconds == Approx(Costs(25e9).block_backward_seconds * 3));
}
