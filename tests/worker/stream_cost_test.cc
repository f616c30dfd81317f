// The streaming planner's cost model: the replayed timeline against hand-computed ones, the
// planner's choice against every hand-picked plan that fits (synthetic figures shaped like
// the H200 measurements in ../shared/GPU.md), and the calibration cache.
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/posix/remove_tree.h"
#include "tests/worker/stream_test_shapes.h"
#include "worker/stream/stream_cost.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

namespace {

// A llama-3-8b block (436 MB) at `tokens`, per block: forward, recompute+backward; the LM
// head with loss, and the optimizer; 55.3 GB/s pinned H2D.
StepCosts H200Like(int64_t tokens) {
  StepCosts c;
  const double scale = static_cast<double>(tokens) / 2048;
  c.block_forward_seconds = 2.3e-3 * scale;
  c.block_backward_seconds = 4.7e-3 * scale;
  c.head_seconds = 50e-3 * scale;
  c.tail_seconds = 13e-3;
  c.h2d_bytes_per_second = 55.3e9;
  return c;
}

}  // namespace

TEST_CASE("calibration: two measured steps split into block, head and tail costs", "[worker]") {
  StepCosts c;
  c.head_seconds = 10e-3;
  // 16 blocks 110 ms, 8 blocks 60 ms: 6.25 ms a block, 0.25 of it the forward; tail 0.
  SplitMeasuredSteps(110e-3, 16, 60e-3, 8, 0.25, &c);
  REQUIRE(c.block_forward_seconds + c.block_backward_seconds == Approx(6.25e-3));
  REQUIRE(c.block_forward_seconds == Approx(0.25 * 6.25e-3));
  REQUIRE(c.tail_seconds == Approx(0).margin(1e-12));
  REQUIRE(c.ResidentStepSeconds(16) == Approx(110e-3));
  // A tail: 16 blocks 115 ms, 8 blocks 65 ms.
  SplitMeasuredSteps(115e-3, 16, 65e-3, 8, 0.25, &c);
  REQUIRE(c.tail_seconds == Approx(5e-3));
  REQUIRE(c.ResidentStepSeconds(16) == Approx(115e-3));
  // Bound by issuing kernels (an H200 at 512 tokens: 17.9 and 43.0 ms, head 2.0 ms): the short
  // step is faster per block than the difference. The deep step is still what is predicted
  // (the tail was clamped at 0 before, and the prediction came out at 52.0 ms).
  c.head_seconds = 1.97e-3;
  SplitMeasuredSteps(42.95e-3, 16, 17.93e-3, 8, 0.26, &c);
  REQUIRE(c.tail_seconds == 0);
  REQUIRE(c.ResidentStepSeconds(16) == Approx(42.95e-3));
  REQUIRE(c.block_forward_seconds > 0);
}

TEST_CASE("calibration: the optimizer measured alone is the least tail", "[worker]") {
  StepCosts c;
  c.head_seconds = 5.68e-3;
  // A 24-block mixture of experts on an H100 (eager steps of 24 and 12 blocks; 18,432 expert
  // LoRA tensors): the difference alone leaves no tail, and the blocks took the optimizer.
  SplitMeasuredSteps(586.5e-3, 24, 287.0e-3, 12, 0.32, &c);
  REQUIRE(c.tail_seconds == 0);
  const double without = c.block_forward_seconds + c.block_backward_seconds;
  // With the optimizer measured alone (100 ms): the tail is that, the blocks the rest, and
  // the deep step is still what is predicted.
  SplitMeasuredSteps(586.5e-3, 24, 287.0e-3, 12, 0.32, &c, 100e-3);
  REQUIRE(c.tail_seconds == Approx(100e-3));
  REQUIRE(c.block_forward_seconds + c.block_backward_seconds ==
          Approx((586.5e-3 - 5.68e-3 - 100e-3) / 24));
  REQUIRE(c.block_forward_seconds + c.block_backward_seconds < without);
  REQUIRE(c.block_forward_seconds ==
          Approx(0.32 * (c.block_forward_seconds + c.block_backward_seconds)));
  REQUIRE(c.ResidentStepSeconds(24) == Approx(586.5e-3));
  // A tail from the difference larger than the floor stays as it was.
  c.head_seconds = 10e-3;
  SplitMeasuredSteps(115e-3, 16, 65e-3, 8, 0.25, &c, 2e-3);
  REQUIRE(c.tail_seconds == Approx(5e-3));
  REQUIRE(c.ResidentStepSeconds(16) == Approx(115e-3));
  // A floor beyond the deep step (a noisy measurement) leaves the blocks nothing, never less.
  SplitMeasuredSteps(115e-3, 16, 65e-3, 8, 0.25, &c, 1.0);
  REQUIRE(c.tail_seconds == Approx(105e-3));
  REQUIRE(c.block_forward_seconds == 0);
  REQUIRE(c.block_backward_seconds == 0);
  REQUIRE(c.ResidentStepSeconds(16) == Approx(115e-3));
}

TEST_CASE("cost model: a resident plan takes the compute's sum", "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  const StepCosts c = H200Like(2048);
  const PredictedStep p = PredictStep(PlanFromSwapCount(16, 0, 2), in.block_bytes, c);
  REQUIRE(p.step_seconds == Approx(c.ResidentStepSeconds(16)));
  REQUIRE(p.h2d_bytes == 0);
  REQUIRE(p.stall_seconds == 0);
  // A taped block's backward runs without its recompute: a forward less per taped block.
  for (int taped : {1, 5, 16}) {
    ResidencyPlan plan = PlanFromSwapCount(16, 0, 2);
    plan.taped_blocks = taped;
    REQUIRE(PredictStep(plan, in.block_bytes, c).step_seconds ==
            Approx(c.ResidentStepSeconds(16) - taped * c.block_forward_seconds));
  }
}

TEST_CASE("cost model: a group's step takes every job's compute and the copies once", "[worker]") {
  const MemoryModelInputs in = Inputs(16, 512);
  const StepCosts a = H200Like(512), b = H200Like(2048);
  const StepCosts g = GroupStepCosts({a, b});
  CHECK(g.block_forward_seconds == Approx(a.block_forward_seconds + b.block_forward_seconds));
  CHECK(g.block_backward_seconds == Approx(a.block_backward_seconds + b.block_backward_seconds));
  CHECK(g.ResidentStepSeconds(16) == Approx(a.ResidentStepSeconds(16) + b.ResidentStepSeconds(16)));
  CHECK(g.h2d_bytes_per_second == a.h2d_bytes_per_second);
  // Streamed, the bytes are one job's: the group's step is bound below by the same copies.
  const ResidencyPlan streamed = PlanFromSwapCount(16, 12, 2);
  const PredictedStep one = PredictStep(streamed, in.block_bytes, a);
  const PredictedStep group = PredictStep(streamed, in.block_bytes, g);
  CHECK(group.h2d_bytes == one.h2d_bytes);
  CHECK(group.step_seconds >= one.step_seconds);
  CHECK(group.stall_seconds <= one.stall_seconds);
  CHECK(GroupStepCosts({a}).ResidentStepSeconds(16) == Approx(a.ResidentStepSeconds(16)));
}

TEST_CASE("cost model: a stacked group's blocks and head are the one batch's, its tail every job's",
          "[worker]") {
  StepCosts one = H200Like(512), stacked = H200Like(2048);
  one.h2d_bytes_per_second = 55e9;
  stacked.h2d_bytes_per_second = 1;  // not stacked's: the first job's
  one.tail_seconds = 0.004;
  const StepCosts g = StackedGroupCosts(one, stacked, 4);
  CHECK(g.block_forward_seconds == stacked.block_forward_seconds);
  CHECK(g.block_backward_seconds == stacked.block_backward_seconds);
  CHECK(g.head_seconds == stacked.head_seconds);
  CHECK(g.tail_seconds == Approx(0.016));
  CHECK(g.h2d_bytes_per_second == 55e9);
}

TEST_CASE("cost model: a plan that streams nothing takes the CUDA graph's factor, no other",
          "[worker]") {
  const MemoryModelInputs in = Inputs(16, 512);
  StepCosts eager = H200Like(512);
  StepCosts graphed = eager;
  graphed.graph_factor = 0.6;
  ResidencyPlan resident = PlanFromSwapCount(16, 0, 2);
  resident.taped_blocks = 16;
  REQUIRE(PredictStep(resident, in.block_bytes, graphed).step_seconds ==
          Approx(0.6 * PredictStep(resident, in.block_bytes, eager).step_seconds));
  REQUIRE(graphed.ResidentStepSeconds(16) == Approx(0.6 * eager.ResidentStepSeconds(16)));
  // Streamed blocks or a streamed head run eagerly (the engine's copies and waits are per step).
  ResidencyPlan head_streamed = PlanFromSwapCount(16, 0, 2);
  head_streamed.head_streamed = true;
  for (const ResidencyPlan& plan : {PlanFromSwapCount(16, 4, 2), head_streamed}) {
    REQUIRE(PredictStep(plan, in.block_bytes, graphed, in.head_bytes).step_seconds ==
            PredictStep(plan, in.block_bytes, eager, in.head_bytes).step_seconds);
  }
  REQUIRE(graphed.Describe().find("CUDA graph x0.600") != std::string::npos);
  REQUIRE(eager.Describe().find("graph") == std::string::npos);
}

TEST_CASE("cost model: an optimizer step of N micro-batches is N passes, its tail once",
          "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  StepCosts c = H200Like(2048);
  c.tail_seconds = 2e-3;
  const double pass = PredictStep(PlanFromSwapCount(16, 12, 2), in.block_bytes, c).step_seconds;
  REQUIRE(OptimizerStepSeconds(pass, c, 1) == pass);
  REQUIRE(OptimizerStepSeconds(pass, c, 0) == pass);  // no accumulation: one pass
  REQUIRE(OptimizerStepSeconds(pass, c, 4) == Approx(4 * pass - 3 * 2e-3));
}

TEST_CASE("cost model: taped blocks never slow a streamed plan; a budget with room tapes all",
          "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  const StepCosts c = H200Like(2048);
  for (int swap : {4, 12, 16}) {
    for (int ring : {1, 2}) {
      ResidencyPlan plan = PlanFromSwapCount(16, swap, ring);
      double previous = PredictStep(plan, in.block_bytes, c).step_seconds;
      for (int taped = 1; taped <= 16; ++taped) {
        CAPTURE(swap, ring, taped);
        plan.taped_blocks = taped;
        const double now = PredictStep(plan, in.block_bytes, c).step_seconds;
        REQUIRE(now <= previous + 1e-12);
        previous = now;
      }
    }
  }
  // Memory for everything: every block resident and taped, the fastest plan there is.
  const PlanChoice roomy = ChoosePlan(in, c, uint64_t{1} << 40);
  const CandidatePlan& chosen = roomy.candidates[roomy.chosen];
  REQUIRE(chosen.plan.num_streamed() == 0);
  REQUIRE(chosen.plan.taped_blocks == 16);
  REQUIRE(chosen.Label().find("taped 16") != std::string::npos);
  REQUIRE(chosen.predicted.step_seconds ==
          Approx(c.ResidentStepSeconds(16) - 16 * c.block_forward_seconds));
}

TEST_CASE("cost model: the replayed timeline of a hand-computed plan", "[worker]") {
  // Two streamed blocks, one slot; forward 1 s, backward 2 s, copy 10 s, no head or tail.
  // Steady pass: block 0 is in the slot from the previous backward; fwd 0 [0,1]; copy 1
  // [1,11]; fwd 1 [11,12]; bwd 1 reuses the slot [12,14]; copy 0 [14,24]; bwd 0 [24,26].
  StepCosts c;
  c.block_forward_seconds = 1;
  c.block_backward_seconds = 2;
  c.h2d_bytes_per_second = 100;
  const std::vector<uint64_t> bytes = {1000, 1000};
  const PredictedStep p = PredictStep(PlanFromSwapCount(2, 2, 1), bytes, c);
  REQUIRE(p.step_seconds == Approx(26));
  REQUIRE(p.h2d_bytes == 2000);
  REQUIRE(p.copy_busy_seconds == Approx(20));
  REQUIRE(p.stall_seconds == Approx(20));  // waits for both copies
  // With a head of 5 s the backward's copy still starts after bwd 1: 31 s.
  c.head_seconds = 5;
  REQUIRE(PredictStep(PlanFromSwapCount(2, 2, 1), bytes, c).step_seconds == Approx(31));
  // Two slots: both blocks stay, nothing is copied in the steady step.
  const PredictedStep two = PredictStep(PlanFromSwapCount(2, 2, 2), bytes, c);
  REQUIRE(two.h2d_bytes == 0);
  REQUIRE(two.step_seconds == Approx(2 * 1 + 5 + 2 * 2));
}

TEST_CASE(
    "cost model: more bandwidth is never slower; a transfer-bound plan is the copies' "
    "time",
    "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  StepCosts c = H200Like(2048);
  const ResidencyPlan all = PlanFromSwapCount(16, 16, 2);
  double previous = 1e9;
  for (double gbps : {5.0, 20.0, 55.3, 200.0}) {
    c.h2d_bytes_per_second = gbps * 1e9;
    const PredictedStep p = PredictStep(all, in.block_bytes, c);
    REQUIRE(p.step_seconds <= previous);
    REQUIRE(p.step_seconds >= c.ResidentStepSeconds(16) - 1e-12);
    REQUIRE(p.step_seconds >= p.copy_busy_seconds);
    previous = p.step_seconds;
  }
  c.h2d_bytes_per_second = 1e9;  // 0.44 s per block: copies dominate everything
  const PredictedStep slow = PredictStep(all, in.block_bytes, c);
  REQUIRE(slow.step_seconds == Approx(slow.copy_busy_seconds).epsilon(0.1));
}

TEST_CASE(
    "the planner's choice is never slower than a hand-picked plan that fits, within "
    "the budget",
    "[worker]") {
  for (int64_t tokens : {512, 2048, 8192}) {
    const MemoryModelInputs in = Inputs(16, tokens);
    const StepCosts c = H200Like(tokens);
    for (double gib : {6.0, 8.0, 10.0, 14.0}) {
      CAPTURE(tokens, gib);
      const uint64_t budget = static_cast<uint64_t>(gib * (1ULL << 30));
      PlanChoice choice;
      try {
        choice = ChoosePlan(in, c, budget);
      } catch (const Error& e) {
        // Only a budget below every plan's minimum may be refused; a dense model's adapter
        // is a small part of that minimum, and the refusal does not point at it.
        REQUIRE(e.code() == ErrorCode::kRefused);
        REQUIRE(EstimateMemory(in, PlanFromSwapCount(16, 16, 1)).total() > budget);
        CHECK(std::string(e.what()).find("lora.rank") == std::string::npos);
        continue;
      }
      const CandidatePlan& chosen = choice.candidates[choice.chosen];
      REQUIRE(chosen.fits);
      REQUIRE(EstimateMemory(in, chosen.plan).total() <= budget);
      int hand_fitting = 0;
      for (int swap = 0; swap <= 16; ++swap) {
        for (int ring = 1; ring <= 4; ++ring) {
          const ResidencyPlan hand = PlanFromSwapCount(16, swap, ring);
          if (EstimateMemory(in, hand).total() > budget) continue;
          ++hand_fitting;
          // Predictions within kPlanTieFraction are ties, settled by the bytes copied.
          const PredictedStep h = PredictStep(hand, in.block_bytes, c);
          REQUIRE(chosen.predicted.step_seconds <= h.step_seconds * (1 + kPlanTieFraction));
          if (chosen.predicted.step_seconds > h.step_seconds)
            REQUIRE(chosen.predicted.h2d_bytes <= h.h2d_bytes);
        }
      }
      REQUIRE(hand_fitting > 0);
      REQUIRE(DescribeChoice(choice, budget).find("chosen: " + chosen.Label()) !=
              std::string::npos);
    }
  }
}

TEST_CASE(
    "at 2048 tokens in 8 GiB the choice beats today's 12-streamed ring of 2, by "
    "resident blocks and by the timeline",
    "[worker]") {
  const StepCosts c = H200Like(2048);
  const ResidencyPlan today = PlanFromSwapCount(16, 12, 2);
  // The chunked head (and the embedding table in host RAM) leave room for more resident
  // blocks; the LM head in one chunk of all 2048 rows (as the whole-sequence logits were)
  // leaves room only for extra slots in the forward and the backward: the timeline.
  for (uint64_t chunk_bytes : {kDefaultHeadChunkBytes, uint64_t{8} << 30}) {
    CAPTURE(chunk_bytes);
    MemoryModelInputs in = Inputs(16, 2048);
    in.head_chunk_bytes = chunk_bytes;
    const PlanChoice choice = ChoosePlan(in, c, 8ULL << 30);
    const CandidatePlan& chosen = choice.candidates[choice.chosen];
    REQUIRE(EstimateMemory(in, today).total() <= (8ULL << 30));
    const PredictedStep t = PredictStep(today, in.block_bytes, c);
    REQUIRE(chosen.predicted.step_seconds < t.step_seconds);
    REQUIRE(chosen.predicted.h2d_bytes < t.h2d_bytes);
    if (chunk_bytes == kDefaultHeadChunkBytes) {
      REQUIRE(chosen.plan.num_streamed() < today.num_streamed());
    } else {
      REQUIRE(chosen.plan.max_slots() > chosen.plan.ring_size);
    }
  }
}

TEST_CASE("cost model: a phase's extra slot is used, never a queue of its own", "[worker]") {
  // The calibration of llama-3-8b's block at 2048 tokens on an H200 (run of 2026-11-30).
  StepCosts c;
  c.block_forward_seconds = 2.00e-3;
  c.block_backward_seconds = 4.25e-3;
  c.head_seconds = 11.21e-3;
  c.tail_seconds = 6.70e-3;
  c.h2d_bytes_per_second = 55.3e9;
  const std::vector<uint64_t> bytes = Inputs(16, 2048).block_bytes;
  const auto step = [&](int forward, int head, int backward) {
    return PredictStep(WithPhaseSlots(PlanFromSwapCount(16, 12, 2), forward, backward, head), bytes,
                       c)
        .step_seconds;
  };
  // A third slot in the forward is filled from the forward's first acquire: the copy engine
  // runs one block ahead for the whole forward. (When the plan kept the ring's slots for the
  // blocks the backward reuses, every other copy of the forward went through the extra slot
  // alone: 198.9 ms, slower than without it, 188.8.)
  REQUIRE(step(3, 2, 2) < step(2, 2, 2) - 1e-3);
  REQUIRE(step(2, 3, 3) < step(2, 2, 2) - 5e-3);
  // Over every plan of 7 and 16 blocks with rings of 2 and 3: one more slot in any phase
  // costs at most a few percent (the greedy slot choice is not optimal; before, up to 38%).
  for (int blocks : {7, 16}) {
    const std::vector<uint64_t> b = Inputs(blocks, 2048).block_bytes;
    for (int swap = 2; swap <= blocks; ++swap) {
      for (int ring = 2; ring <= 3; ++ring) {
        for (int f = ring; f <= swap; ++f) {
          for (int bw = ring; bw <= swap; ++bw) {
            for (int h = ring; h <= bw; ++h) {
              const auto at = [&](int ff, int hh, int bb) {
                return PredictStep(
                           WithPhaseSlots(PlanFromSwapCount(blocks, swap, ring), ff, bb, hh), b, c)
                    .step_seconds;
              };
              CAPTURE(blocks, swap, ring, f, h, bw);
              const double t = at(f, h, bw);
              if (f < swap) REQUIRE(at(f + 1, h, bw) <= t * 1.05);
              if (bw < swap) REQUIRE(at(f, h, bw + 1) <= t * 1.05);
              if (h < bw) REQUIRE(at(f, h + 1, bw) <= t * 1.05);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("cost model: a streamed LM head's copy is waited for before the head", "[worker]") {
  // Resident blocks: the copy engine is idle when the forward ends, so the head's copy
  // (issued then) adds its whole time to the step, as a stall.
  const MemoryModelInputs in = InputsFor(Qwen3_8bShape(), 2048);
  const StepCosts c = H200Like(2048);
  ResidencyPlan plan = PlanFromSwapCount(36, 0, 2);
  const PredictedStep resident = PredictStep(plan, in.block_bytes, c, in.head_bytes);
  plan.head_streamed = true;
  const PredictedStep streamed = PredictStep(plan, in.block_bytes, c, in.head_bytes);
  const double copy = in.head_bytes / c.h2d_bytes_per_second;
  REQUIRE(streamed.step_seconds == Approx(resident.step_seconds + copy));
  REQUIRE(streamed.stall_seconds == Approx(copy));
  REQUIRE(streamed.h2d_bytes == in.head_bytes);
  // At 5 GiB the Qwen3-8B shape is accepted; the choice fits and streams most blocks.
  const PlanChoice choice = ChoosePlan(in, c, 5ULL << 30);
  const CandidatePlan& chosen = choice.candidates[choice.chosen];
  REQUIRE(chosen.fits);
  REQUIRE(chosen.peak_bytes <= (5ULL << 30));
  INFO(DescribeChoice(choice, 5ULL << 30));
  // Never slower than the budget's plan without a cost model (the head resident, 34 blocks
  // streamed), among whose alternatives it also weighs streaming the head.
  const ResidencyPlan simple = PlanFromBudget(in, 5ULL << 30, 2);
  REQUIRE(chosen.predicted.step_seconds <=
          PredictStep(simple, in.block_bytes, c, in.head_bytes).step_seconds);
  REQUIRE(DescribeChoice(choice, 5ULL << 30).find("head streamed") != std::string::npos);
}

TEST_CASE("a budget below every plan is refused with the minimum", "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  try {
    ChoosePlan(in, H200Like(2048), 1ULL << 30);
    FAIL("1 GiB accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kRefused);
    REQUIRE(std::string(e.what()).find("gpu_memory_budget") != std::string::npos);
  }
}

TEST_CASE("the calibration cache: round trip, damaged files and other keys are not trusted",
          "[worker]") {
  char templ[] = "/tmp/lorastream_cost_XXXXXX";
  REQUIRE(mkdtemp(templ) != nullptr);
  const std::string dir = templ;
  REQUIRE(setenv("LORASTREAM_CACHE_DIR", dir.c_str(), 1) == 0);
  const std::string key = "model/x-llama-L16-cuda:0-BFloat16-r16-T2048";
  REQUIRE(CalibrationCachePath(key).rfind(dir + "/calibration/", 0) == 0);
  REQUIRE(CalibrationCachePath(key).find('/', dir.size() + 13) == std::string::npos);
  StepCosts got;
  REQUIRE_FALSE(LoadStepCosts(key, &got));  // nothing cached yet
  StepCosts want = H200Like(2048);
  want.graph_factor = 0.625;
  want.block_expand_seconds = 0.3e-3;
  SaveStepCosts(key, want);
  REQUIRE(LoadStepCosts(key, &got));
  REQUIRE(got.block_expand_seconds == want.block_expand_seconds);
  REQUIRE(got.block_forward_seconds == want.block_forward_seconds);
  REQUIRE(got.block_backward_seconds == want.block_backward_seconds);
  REQUIRE(got.head_seconds == want.head_seconds);
  REQUIRE(got.tail_seconds == want.tail_seconds);
  REQUIRE(got.h2d_bytes_per_second == want.h2d_bytes_per_second);
  REQUIRE(got.graph_factor == want.graph_factor);
  // An entry without graph_factor (measured without CUDA graphs) reads as 1; a factor that
  // is not positive is not trusted.
  std::stringstream text;
  text << std::ifstream(CalibrationCachePath(key)).rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str());
  j.erase("graph_factor");
  j.erase("block_expand_seconds");  // an entry of a plain store's
  std::ofstream(CalibrationCachePath(key)) << j.dump();
  REQUIRE(LoadStepCosts(key, &got));
  REQUIRE(got.graph_factor == 1);
  REQUIRE(got.block_expand_seconds == 0);
  j["graph_factor"] = 0;
  std::ofstream(CalibrationCachePath(key)) << j.dump();
  REQUIRE_FALSE(LoadStepCosts(key, &got));
  REQUIRE_FALSE(LoadStepCosts(key + "-other", &got));
  std::ofstream(CalibrationCachePath(key)) << "{\"key\": \"" << key << "\", \"head_sec";
  REQUIRE_FALSE(LoadStepCosts(key, &got));  // damaged: measured again
  unsetenv("LORASTREAM_CACHE_DIR");
  RemoveTree(dir);
}

TEST_CASE("cost model: a compressed block expands at each use that does not find it expanded",
          "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  const StepCosts plain = H200Like(2048);
  StepCosts c = plain;
  c.block_expand_seconds = 0.25e-3;
  // Resident: every use but the turnaround's second (the scratch still holds block 15).
  const ResidencyPlan resident = PlanFromSwapCount(16, 0, 2);
  CHECK(c.ResidentStepSeconds(16) == Approx(plain.ResidentStepSeconds(16) + 31 * 0.25e-3));
  CHECK(PredictStep(resident, in.block_bytes, c).step_seconds == Approx(c.ResidentStepSeconds(16)));
  // Streamed: every block stays compressed in its slot and expands at each use into the one
  // scratch, as a resident one does: 31 expansions again, all of them on the compute stream
  // when the copies cost nothing.
  const ResidencyPlan streamed = PlanFromSwapCount(16, 12, 2);
  const std::vector<uint64_t> tiny(16, 4096);
  CHECK(PredictStep(streamed, tiny, c).step_seconds ==
        Approx(PredictStep(streamed, tiny, plain).step_seconds + 31 * 0.25e-3));
  // With halved blocks some of the copies' time is still exposed: the expansions add at most
  // their sum.
  std::vector<uint64_t> half = in.block_bytes;
  for (uint64_t& b : half) b /= 2;
  const PredictedStep a = PredictStep(streamed, half, plain);
  const PredictedStep b = PredictStep(streamed, half, c);
  CHECK(b.step_seconds > a.step_seconds);
  CHECK(b.step_seconds <= a.step_seconds + 31 * 0.25e-3 + 1e-9);
  CHECK(b.h2d_bytes == a.h2d_bytes);
}

namespace {

// What an H100 calibrated for a Qwen3-30B-A3B-shaped block at 2048 tokens (rank 16 on attention
// and every expert; docs/MOE.md).
StepCosts MoeH100Costs() {
  StepCosts k;
  k.block_forward_seconds = 7.80e-3;
  k.block_backward_seconds = 16.40e-3;
  k.head_seconds = 5.68e-3;
  k.h2d_bytes_per_second = 53.0e9;
  k.graph_factor = 0.656;
  return k;
}

}  // namespace

TEST_CASE("cost model: a mixture of experts' optimizer tail moves its plan", "[worker]") {
  // 24 blocks of Qwen3-30B-A3B's shape at 2048 tokens within 24 GiB, with the costs an H100
  // calibrated (docs/MOE.md): block forward 7.80 ms, recompute+backward 16.40 ms, head 5.68
  // ms, H2D 53.0 GB/s, graphs x0.656, and no tail: the steps' difference had put the optimizer
  // over 18,432 expert LoRA tensors in the blocks' share.
  const MemoryModelInputs in = testing::InputsFor(testing::Qwen3MoeShape(24), 2048);
  const StepCosts k = MoeH100Costs();
  // The plan that ran (16 streamed through 4 slots, the last 9 taped), as the run's log
  // predicted it: 0.629 s (measured 0.873 s).
  ResidencyPlan ran = PlanFromSwapCount(24, 16, 4);
  ran.taped_blocks = 9;
  REQUIRE(PredictStep(ran, in.block_bytes, k).step_seconds == Approx(0.629).margin(1e-3));
  // The same eager steps split with a 105 ms tail measured alone: the blocks get the rest.
  StepCosts t = k;
  const double deep = 24 * (k.block_forward_seconds + k.block_backward_seconds) + k.head_seconds;
  SplitMeasuredSteps(deep, 24, 287.0e-3, 12, 7.80 / 24.20, &t, 0.105);
  REQUIRE(t.tail_seconds == Approx(0.105));
  REQUIRE(t.ResidentStepSeconds(24) == Approx(k.ResidentStepSeconds(24)));
  const double ran_predicted = PredictStep(ran, in.block_bytes, t).step_seconds;
  REQUIRE(ran_predicted > 0.70);  // 0.712 s: copies no block hides during the optimizer
  // The planner's choice with the tail: none taped, predicted faster than the plan that ran.
  const PlanChoice choice = ChoosePlan(in, t, uint64_t{24} << 30);
  REQUIRE(choice.chosen >= 0);
  const CandidatePlan& chosen = choice.candidates[static_cast<size_t>(choice.chosen)];
  CHECK(chosen.plan.taped_blocks == 0);
  CHECK(chosen.predicted.step_seconds < ran_predicted);
}

TEST_CASE("planner: the whole Qwen3-30B-A3B on an NF4 store within 16 GiB", "[worker]") {
  // The 48 blocks as the NF4 store holds them (322,490,368 bytes each, measured: docs/MOE.md),
  // each expanding to its 1,246,241,280 bf16 bytes, 2048 tokens.
  MemoryModelInputs in = testing::InputsFor(testing::Qwen3MoeShape(48), 2048);
  REQUIRE(in.block_bytes[0] == 1246241280);
  in.expanded_bytes = in.block_bytes;
  for (uint64_t& b : in.block_bytes) b = 322490368;
  StepCosts k = MoeH100Costs();
  k.tail_seconds = 0.2;
  const uint64_t budget = uint64_t{16} << 30;
  // Rank 16 on attention and every expert: 845M LoRA parameters, whose f32 weights, gradients
  // and AdamW moments alone take 12.6 GiB: no plan fits, and the refusal names the minimum.
  try {
    ChoosePlan(in, k, budget);
    FAIL("rank 16 on every expert planned within 16 GiB");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("below the minimum of 18614326784 bytes (17.3 GiB)") != std::string::npos);
    // Most of that minimum is the adapter's state: the refusal says what shrinks it.
    CHECK(what.find("GiB) of it are the adapters' f32 weights, gradients and AdamW moments") !=
          std::string::npos);
    CHECK(what.find("only a lower lora.rank or fewer lora.targets shrink") != std::string::npos);
    CHECK(what.find("or optim.type = \"adamw8bit\"") != std::string::npos);
  }
  // With 8-bit moments (optim.type = "adamw8bit") the same adapter fits: its state takes
  // 10 bytes and 1/32 a parameter instead of 16, and the plan streams most blocks.
  in.eight_bit_optimizer = true;
  {
    const PlanChoice choice = ChoosePlan(in, k, budget);
    REQUIRE(choice.chosen >= 0);
    const CandidatePlan& chosen = choice.candidates[static_cast<size_t>(choice.chosen)];
    CHECK(chosen.peak_bytes <= budget);
    const MemoryEstimate e = EstimateMemory(in, chosen.plan);
    const uint64_t params =
        static_cast<uint64_t>(LoraParameterCount(in.config, in.lora_rank, in.lora_targets));
    CHECK(e.adapter == params * 8 + 2 * (params + params / kEightBitBlock * 4));
    CHECK(chosen.plan.num_streamed() >= 40);
  }
  in.eight_bit_optimizer = false;
  // Rank 16 on attention alone fits, most blocks streamed.
  in.lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj"};
  const PlanChoice choice = ChoosePlan(in, k, budget);
  REQUIRE(choice.chosen >= 0);
  const CandidatePlan& chosen = choice.candidates[static_cast<size_t>(choice.chosen)];
  CHECK(chosen.peak_bytes <= budget);
  CHECK(chosen.plan.num_streamed() == 43);
}

TEST_CASE("planner: Qwen3-30B-A3B jobs (24 blocks) as a group within 24 GiB, with 8-bit moments",
          "[worker]") {
  // Rank 16 on attention and every expert, 2048 tokens each: with f32 moments a job's adapter
  // state is 6.3 GiB, and the group's smallest plan does not fit beyond two jobs; with 8-bit
  // moments (10 bytes and 1/32 a parameter instead of 16) four fit. (Three such jobs on an
  // H100 planned 23.45 GiB and peaked at 22.82 GiB: docs/MOE.md.)
  const uint64_t budget = uint64_t{24} << 30;
  int fits[2] = {0, 0};
  for (int eight = 0; eight < 2; ++eight) {
    MemoryModelInputs in = testing::InputsFor(testing::Qwen3MoeShape(24), 2048);
    in.lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj", "experts"};
    in.eight_bit_optimizer = eight == 1;
    for (int k = 1; k <= 6; ++k) {
      if (!GroupBudgetRefusal(in, budget, "job0").empty()) break;
      fits[eight] = k;
      in.group.push_back({"job" + std::to_string(k), 2048, 16, 0.0, in.lora_targets, eight == 1});
    }
  }
  INFO("f32 moments: " << fits[0] << " jobs; 8-bit: " << fits[1]);
  CHECK(fits[0] == 2);
  CHECK(fits[1] == 4);
}
