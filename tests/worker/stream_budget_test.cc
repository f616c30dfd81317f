// Planning the resident set from a GPU memory budget: the estimate's terms, budgets that are
// just enough and just too small, and the refusal's message.
#include <algorithm>

#include <catch2/catch.hpp>

#include "common/error.h"
#include "worker/stream_budget.h"
#include "tests/worker/stream_test_shapes.h"

using namespace lorastream;
using namespace lorastream::testing;

TEST_CASE("LoRA parameter count of a llama-3-8b-shaped block", "[worker]") {
  const ModelConfig c = Llama3_8bShape(16);
  // q 16*(4096+4096) + k,v 2*16*(4096+1024) + o 16*(4096+4096) + gate,up,down 3*16*(4096+14336)
  REQUIRE(LoraParameterCount(c, 16, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"}) == 16 * 1310720LL);
  REQUIRE(LoraParameterCount(c, 8, {"q_proj"}) == 16 * 8 * 8192LL);
  REQUIRE_THROWS_AS(LoraParameterCount(c, 8, {"lm_head"}), Error);
}

TEST_CASE("the memory estimate follows its documented formula", "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  const ResidencyPlan plan = PlanFromSwapCount(16, 12, 2);
  const MemoryEstimate e = EstimateMemory(in, plan);
  const uint64_t block = in.block_bytes[0];
  REQUIRE(block == 436207616ULL + 4 * 4096);  // 218M bf16 parameters and two norms
  REQUIRE(e.resident_blocks == 4 * block);
  REQUIRE(e.ring == 2 * block);
  REQUIRE(e.rest == in.rest_bytes);
  REQUIRE(e.adapter == 16ULL * 1310720 * 16);
  REQUIRE(e.checkpoints == 16ULL * 2048 * 4096 * 2);
  REQUIRE(e.block_working ==
          2048ULL * 2 * (8 * 4096 + 4 * (4096 + 2 * 1024) + 6 * 14336) + 2048ULL * 2 * 16 * 2 * 7);
  REQUIRE(e.attention == 32ULL * 2048 * 4);
  REQUIRE(e.lm_head == 2048ULL * 128256 * 10);
  REQUIRE(e.forward_working == 2048ULL * 2 * (4 * 4096 + 4096 + 2 * 1024 + 3 * 14336));
  // The timeline: three phases, the peak the largest.
  const uint64_t fixed = e.rest + e.resident_blocks + e.adapter + e.checkpoints + e.reserve;
  REQUIRE(e.forward() == fixed + 2 * block + e.forward_working + e.attention);
  REQUIRE(e.head() == fixed + e.ring + e.lm_head);
  REQUIRE(e.backward() == fixed + 2 * block + e.block_working + e.attention);
  REQUIRE(e.total() == std::max({e.forward(), e.head(), e.backward()}));
  // At 2048 tokens the LM head's buffers are the peak: the forward and the backward have
  // room for more slots.
  REQUIRE(e.total() == e.head());
  REQUIRE(e.forward() + 2 * block < e.head());
  // Phase slots raise only their phase.
  const MemoryEstimate more = EstimateMemory(in, WithPhaseSlots(plan, 5, 4));
  REQUIRE(more.forward() == e.forward() + 3 * block);
  REQUIRE(more.backward() == e.backward() + 2 * block);
  REQUIRE(more.head() == e.head());
  MemoryModelInputs materialized = in;
  materialized.attention_materialized = true;
  REQUIRE(EstimateMemory(materialized, plan).attention == 32ULL * 2048 * 2048 * 2 * 2);
  REQUIRE(e.Describe().find("ring") != std::string::npos);
}

TEST_CASE("a budget plans the largest resident set that fits", "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  for (int resident = 0; resident <= 16; ++resident) {
    CAPTURE(resident);
    const ResidencyPlan want = PlanFromSwapCount(16, 16 - resident, 2);
    const uint64_t need = EstimateMemory(in, want).total();
    // Just enough: at least `resident` blocks stay (more where the ring they no longer need
    // pays for them: 14 resident + 2 slots cost what 16 resident cost), within the budget.
    const ResidencyPlan got = PlanFromBudget(in, need, 2);
    REQUIRE(16 - got.num_streamed() >= resident);
    REQUIRE(EstimateMemory(in, got).total() <= need);
    if (16 - got.num_streamed() == resident) REQUIRE(got.streamed == want.streamed);
    if (resident > 0) {
      // Just too small: fewer resident blocks, and the plan fits the smaller budget.
      const ResidencyPlan less = PlanFromBudget(in, need - 1, 2);
      REQUIRE(16 - less.num_streamed() < resident);
      REQUIRE(EstimateMemory(in, less).total() <= need - 1);
    }
  }
  // All resident needs no ring at all.
  const ResidencyPlan all = PlanFromBudget(in, ~uint64_t{0}, 2);
  REQUIRE(all.num_streamed() == 0);
  REQUIRE(all.ring_size == 0);
}

TEST_CASE("a budget below the minimum is refused with the bytes needed", "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  const uint64_t minimum = EstimateMemory(in, PlanFromSwapCount(16, 16, 2)).total();
  try {
    PlanFromBudget(in, minimum - 1, 2);
    FAIL("budget below the minimum accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kRefused);
    const std::string msg = e.what();
    REQUIRE(msg.find("gpu_memory_budget") != std::string::npos);
    REQUIRE(msg.find(std::to_string(minimum)) != std::string::npos);
  }
  // A ring of 1 lowers the minimum by one block.
  const uint64_t minimum1 = EstimateMemory(in, PlanFromSwapCount(16, 16, 1)).total();
  REQUIRE(minimum1 == minimum - in.block_bytes[0]);
  REQUIRE(PlanFromBudget(in, minimum1, 1).num_streamed() == 16);
  REQUIRE_THROWS_AS(PlanFromBudget(in, minimum, 0), Error);
}

TEST_CASE("the 8 GiB benchmark budget at 2048 tokens", "[worker]") {
  const ResidencyPlan p = PlanFromBudget(Inputs(16, 2048), 8ULL << 30, 2);
  // Documented in the benchmark: the estimate leaves room for a few resident blocks.
  REQUIRE(p.num_streamed() < 16);
  REQUIRE(p.num_streamed() > 8);
  REQUIRE(p.ring_size == 2);
}

TEST_CASE("the timeline at ring 2's peak: more slots in the forward than in the backward",
          "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  const ResidencyPlan ring2 = PlanFromSwapCount(16, 12, 2);
  const uint64_t peak = EstimateMemory(in, ring2).total();
  const ResidencyPlan timeline = FillPhaseSlots(in, ring2, peak);
  // The forward lacks the recompute's working set that the backward has: it gets more.
  REQUIRE(timeline.forward_slots > timeline.backward_slots);
  REQUIRE(timeline.backward_slots > 2);
  REQUIRE(timeline.ring_size == 2);
  // The peak does not rise, and one more slot in either phase would raise it.
  const MemoryEstimate e = EstimateMemory(in, timeline);
  REQUIRE(e.total() == peak);
  REQUIRE(EstimateMemory(in, WithPhaseSlots(timeline, timeline.forward_slots + 1, 0)).total() >
          peak);
  REQUIRE(EstimateMemory(in, WithPhaseSlots(timeline, 0, timeline.backward_slots + 1)).total() >
          peak);
  // A budget fills the phases the same way.
  const ResidencyPlan b = PlanFromBudget(in, peak, 2);
  REQUIRE(b.num_streamed() == 12);
  REQUIRE(b.forward_slots == timeline.forward_slots);
  REQUIRE(b.backward_slots == timeline.backward_slots);
}
