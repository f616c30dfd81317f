// Planning the resident set from a GPU memory budget: the estimate's terms, budgets that are
// just enough and just too small, and the refusal's message.
#include <algorithm>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/manifest.h"
#include "tests/worker/stream_test_shapes.h"
#include "worker/stream/stream_budget.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

TEST_CASE("LoRA parameter count of a llama-3-8b-shaped block", "[worker]") {
  const ModelConfig c = Llama3_8bShape(16);
  // q 16*(4096+4096) + k,v 2*16*(4096+1024) + o 16*(4096+4096) + gate,up,down 3*16*(4096+14336)
  REQUIRE(LoraParameterCount(c, 16,
                             {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"}) == 16 * 1310720LL);
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
  // On the device: the final norm and the LM head; the embedding table stays in host RAM.
  REQUIRE(e.rest == 4096ULL * 2);
  REQUIRE(e.head_weights == 128256ULL * 4096 * 2);
  REQUIRE_FALSE(e.head_streamed);
  REQUIRE(e.adapter == 16ULL * 1310720 * 16);
  // Each block's adapter in bf16, held from its forward to its backward, with q/k/v's and
  // gate/up's A factors concatenated once more; none in f32, where the adapter is its own.
  REQUIRE(e.adapter_cast == (16ULL * 1310720 + 16ULL * 16 * 4096 * (3 + 2)) * 2);
  MemoryModelInputs f32 = in;
  f32.compute_bytes = 4;
  REQUIRE(EstimateMemory(f32, plan).adapter_cast == 0);
  MemoryModelInputs q_only = in;
  q_only.lora_targets = {"q_proj", "o_proj"};
  REQUIRE(EstimateMemory(q_only, plan).adapter_cast ==
          2ULL * LoraParameterCount(in.config, 16, q_only.lora_targets));
  REQUIRE(e.checkpoints == 16ULL * 2048 * 4096 * 2);
  REQUIRE(e.block_working ==
          2048ULL * 2 * (8 * 4096 + 4 * (4096 + 2 * 1024) + 6 * 14336) + 2048ULL * 2 * 16 * 2 * 7);
  REQUIRE(e.attention == 32ULL * 2048 * 4);
  // The chunked head: 245 rows of f32 logits and log-probabilities plus the norm's saved
  // tensors fit 256 MiB; the last hidden state and its gradient. Not 2048 x 128256 logits.
  REQUIRE(HeadChunkRows(2048, 128256, 4096, kDefaultHeadChunkBytes) == 245);
  REQUIRE(e.head_chunk_rows == 245);
  REQUIRE(e.lm_head == 245ULL * (128256 * 8 + 4096 * 16) + 2 * 2048ULL * 4096 * 2);
  // With the fused cross entropy (CUDA, bf16) a row holds its bf16 logits, which their
  // gradient overwrites, and its loss: 833 rows fit the same bound, three chunks at 2048
  // tokens instead of nine (each chunk reads the LM head's weights twice).
  REQUIRE(HeadChunkRowBytes(128256, 4096, true) == 2 * 128256 + 4 + 16 * 4096);
  REQUIRE(HeadChunkRows(2048, 128256, 4096, kDefaultHeadChunkBytes, true) == 833);
  MemoryModelInputs fused = in;
  fused.fused_cross_entropy = true;
  const MemoryEstimate f = EstimateMemory(fused, plan);
  REQUIRE(f.head_chunk_rows == 833);
  REQUIRE(f.lm_head == 833ULL * (2 * 128256 + 4 + 16 * 4096) + 2 * 2048ULL * 4096 * 2);
  REQUIRE(f.lm_head <= kDefaultHeadChunkBytes + 2 * 2048ULL * 4096 * 2);
  REQUIRE(e.forward_working == 2048ULL * 2 * (4 * 4096 + 4096 + 2 * 1024 + 3 * 14336));
  // The timeline: four phases, the peak the largest.
  const uint64_t fixed =
      e.rest + e.head_weights + e.resident_blocks + e.adapter + e.checkpoints + e.reserve;
  REQUIRE(e.forward() == fixed + e.adapter_cast + 2 * block + e.forward_working + e.attention);
  REQUIRE(e.head() == fixed + e.adapter_cast + e.ring + e.lm_head);
  REQUIRE(e.backward() == fixed + e.adapter_cast + 2 * block + e.block_working + e.attention);
  // The optimizer: sqrt(v) over one run of parameters (4 bytes each, 64 MiB at most).
  REQUIRE(e.optimizer_scratch == std::min<uint64_t>(16ULL * 1310720 * 4, 64ULL << 20));
  REQUIRE(e.optimizer() == fixed + e.ring + e.optimizer_scratch);
  REQUIRE(e.total() == std::max({e.forward(), e.head(), e.backward(), e.optimizer()}));
  // At 2048 tokens the chunked head's buffers are below the recomputed block's: the backward
  // is the peak, and the forward and the LM head have room for more.
  REQUIRE(e.total() == e.backward());
  REQUIRE(e.head() < e.backward());
  REQUIRE(e.forward() < e.backward());
  // A streamed head is on the device during the LM head only.
  ResidencyPlan streamed_head = plan;
  streamed_head.head_streamed = true;
  const MemoryEstimate s = EstimateMemory(in, streamed_head);
  REQUIRE(s.fixed() == e.fixed() - e.head_weights);
  REQUIRE(s.head() == e.head());
  REQUIRE(s.forward() == e.forward() - e.head_weights);
  REQUIRE(s.backward() == e.backward() - e.head_weights);
  REQUIRE(s.Describe().find("streamed") != std::string::npos);
  // Phase slots raise only their phase.
  const MemoryEstimate more = EstimateMemory(in, WithPhaseSlots(plan, 5, 4));
  REQUIRE(more.forward() == e.forward() + 3 * block);
  REQUIRE(more.backward() == e.backward() + 2 * block);
  REQUIRE(more.head() == e.head());
  MemoryModelInputs materialized = in;
  materialized.attention_materialized = true;
  REQUIRE(EstimateMemory(materialized, plan).attention == 32ULL * 2048 * 2048 * 2 * 2);
  REQUIRE(e.Describe().find("slots") != std::string::npos);
  // Taped blocks: each tape is held through the forward and the LM head; the backward's
  // first block's tape is part of its working set.
  REQUIRE(e.tape == 2048ULL * 2 * (3 * 4096 + 4 * 4096 + 3 * 1024 + 3 * 14336) +
                        2048ULL * 2 * 16 * 7 + 32ULL * 2048 * 4 + 2048ULL * 4 * (2 + 32 + 8));
  ResidencyPlan taped = plan;
  taped.taped_blocks = 3;
  const MemoryEstimate t3 = EstimateMemory(in, taped);
  REQUIRE(t3.forward() == e.forward() + 3 * e.tape);
  REQUIRE(t3.head() == e.head() + 3 * e.tape);
  REQUIRE(t3.backward() == e.backward() + 2 * e.tape);
  REQUIRE(t3.Describe().find("3 taped blocks") != std::string::npos);
  taped.taped_blocks = 1;
  REQUIRE(EstimateMemory(in, taped).backward() == e.backward());
  // LoRA dropout: each adapted projection's dropped input and its mask (q, k, v, gate, up
  // read the hidden width, o the attention's, down the intermediate's).
  MemoryModelInputs dropout = in;
  dropout.lora_dropout = 0.05;
  const MemoryEstimate d = EstimateMemory(dropout, plan);
  const uint64_t dropped = 2048ULL * 3 * (5 * 4096 + 4096 + 14336);
  REQUIRE(d.block_working == e.block_working + dropped);
  REQUIRE(d.tape == e.tape + dropped);
}

TEST_CASE("a budget's headroom becomes taped blocks, within the budget", "[worker]") {
  const MemoryModelInputs in = Inputs(16, 2048);
  const ResidencyPlan plan = PlanFromSwapCount(16, 12, 2);
  const MemoryEstimate e = EstimateMemory(in, plan);
  const int at_peak = FillTapedBlocks(in, plan, e.total()).taped_blocks;
  int last = at_peak;
  for (uint64_t budget : {e.total() + e.tape, e.total() + 5 * e.tape, uint64_t{1} << 40}) {
    const ResidencyPlan got = FillTapedBlocks(in, plan, budget);
    CAPTURE(budget, got.taped_blocks);
    REQUIRE(got.taped_blocks >= last);
    last = got.taped_blocks;
    REQUIRE(EstimateMemory(in, got).total() <= budget);
    if (got.taped_blocks < 16) {
      ResidencyPlan more = got;
      ++more.taped_blocks;
      REQUIRE(EstimateMemory(in, more).total() > budget);
    }
  }
  REQUIRE(last == 16);
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
  // The minimum: every block streamed and the LM head too (a budget below the resident
  // head's minimum streams the head rather than being refused).
  ResidencyPlan all = PlanFromSwapCount(16, 16, 2);
  REQUIRE_FALSE(PlanFromBudget(in, EstimateMemory(in, all).total(), 2).head_streamed);
  REQUIRE(PlanFromBudget(in, EstimateMemory(in, all).total() - 1, 2).head_streamed);
  all.head_streamed = true;
  const uint64_t minimum = EstimateMemory(in, all).total();
  try {
    PlanFromBudget(in, minimum - 1, 2);
    FAIL("budget below the minimum accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kRefused);
    const std::string msg = e.what();
    REQUIRE(msg.find("gpu_memory_budget") != std::string::npos);
    REQUIRE(msg.find(std::to_string(minimum)) != std::string::npos);
    // A dense model's adapter is a small part of the minimum: no word on it.
    CHECK(msg.find("lora.rank") == std::string::npos);
  }
  // A ring of 1 lowers the minimum by one block.
  ResidencyPlan all1 = PlanFromSwapCount(16, 16, 1);
  all1.head_streamed = true;
  const uint64_t minimum1 = EstimateMemory(in, all1).total();
  REQUIRE(minimum1 == minimum - in.block_bytes[0]);
  REQUIRE(PlanFromBudget(in, minimum1, 1).num_streamed() == 16);
  REQUIRE_THROWS_AS(PlanFromBudget(in, minimum, 0), Error);
}

TEST_CASE("the 8 GiB benchmark budget at 2048 tokens", "[worker]") {
  const ResidencyPlan p = PlanFromBudget(Inputs(16, 2048), 8ULL << 30, 2);
  // With the embedding table in host RAM and the LM head in chunks, 11 of 16 blocks stay
  // (the full logits and both tables on the device left room for 4: 12 streamed).
  REQUIRE(p.num_streamed() == 5);
  REQUIRE_FALSE(p.head_streamed);
  REQUIRE(p.ring_size == 2);
}

TEST_CASE("the timeline at ring 2's peak: more slots in the forward than in the backward",
          "[worker]") {
  // The LM head in one chunk of all 2048 rows (as the whole-sequence logits were): the head
  // is the peak, the forward and the backward have headroom.
  MemoryModelInputs in = Inputs(16, 2048);
  in.head_chunk_bytes = uint64_t{8} << 30;
  REQUIRE(EstimateMemory(in, PlanFromSwapCount(16, 12, 2)).head_chunk_rows == 2048);
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

TEST_CASE("a Qwen3-8B-shaped model trains at 2048 tokens within 5 GiB", "[worker]") {
  const MemoryModelInputs in = InputsFor(Qwen3_8bShape(), 2048);
  const uint64_t gib = uint64_t{1} << 30;
  REQUIRE(in.block_bytes[0] == 385892864ULL);  // 192.9M bf16 parameters per block
  // Every block streamed through 2 slots, the head resident: 4.20 GiB, the backward's peak
  // (the embedding table is not on the device; the chunked head's working set is 0.28 GiB:
  // 209 rows of 1.28 MB, plus the last hidden state and its gradient).
  const ResidencyPlan all = PlanFromSwapCount(36, 36, 2);
  const MemoryEstimate e = EstimateMemory(in, all);
  REQUIRE(e.head_chunk_rows == 209);
  REQUIRE(e.lm_head == 209ULL * (151936 * 8 + 4096 * 16) + 2 * 2048ULL * 4096 * 2);
  REQUIRE(e.lm_head < gib * 3 / 10);  // was 2.90 GiB of full logits
  REQUIRE(e.total() == e.backward());
  REQUIRE(e.total() == 4504593408ULL);
  // The LM head streamed as well: the head's phase is the peak, 3.97 GiB.
  ResidencyPlan all_head = all;
  all_head.head_streamed = true;
  REQUIRE(EstimateMemory(in, all_head).total() == 4267831296ULL);
  // 5 GiB is accepted: the head stays resident and 2 blocks besides it.
  const uint64_t budget = 5 * gib;
  const ResidencyPlan p = PlanFromBudget(in, budget, 2);
  REQUIRE(EstimateMemory(in, p).total() <= budget);
  REQUIRE(p.num_streamed() == 34);
  REQUIRE_FALSE(p.head_streamed);
  REQUIRE(p.forward_slots > p.ring_size);  // the forward's headroom holds more slots
  // Below the resident head's minimum the head is streamed rather than refused; below the
  // streamed head's minimum the refusal names it.
  const ResidencyPlan tight = PlanFromBudget(in, e.total() - 1, 2);
  REQUIRE(tight.head_streamed);
  REQUIRE(tight.num_streamed() == 36);
  try {
    PlanFromBudget(in, 4267831296ULL - 1, 2);
    FAIL("a budget below the minimum accepted");
  } catch (const Error& error) {
    REQUIRE(error.code() == ErrorCode::kRefused);
    REQUIRE(std::string(error.what()).find("4267831296") != std::string::npos);
    REQUIRE(std::string(error.what()).find("LM head streamed") != std::string::npos);
  }
  // A ring of 1 lowers the minimum to 3.62 GiB.
  REQUIRE(PlanFromBudget(in, 4267831296ULL - in.block_bytes[0], 1).head_streamed);
}

TEST_CASE(
    "a group's estimate: each job's activations and adapter beside one set of slots; a "
    "group that does not fit is refused naming the job and by how much",
    "[worker]") {
  const MemoryModelInputs one = Inputs(16, 512);
  const ResidencyPlan plan = PlanFromSwapCount(16, 12, 2);
  const MemoryEstimate alone = EstimateMemory(one, plan);
  MemoryModelInputs group = one;
  for (int j = 0; j < 3; ++j)
    group.group.push_back({"copy-" + std::to_string(j), one.tokens, one.lora_rank, one.lora_dropout,
                           one.lora_targets});
  const MemoryEstimate four = EstimateMemory(group, plan);
  // Four jobs like the first: every per-job term four times, the weights and slots once.
  CHECK(four.adapter == 4 * alone.adapter);
  CHECK(four.adapter_cast == 4 * alone.adapter_cast);  // each job's blocks cast for its own
  CHECK(four.checkpoints == 4 * alone.checkpoints);
  CHECK(four.block_working == 4 * alone.block_working);
  CHECK(four.forward_working == 4 * alone.forward_working);
  CHECK(four.tape == 4 * alone.tape);
  CHECK(four.attention == 4 * alone.attention);
  CHECK(four.ring == alone.ring);
  CHECK(four.resident_blocks == alone.resident_blocks);
  CHECK(four.head_weights == alone.head_weights);
  // The head's chunks run one job after another: one chunk's working set, every job's kept
  // last hidden state and its gradient.
  const uint64_t kept = 2 * 512ULL * 4096 * 2;
  CHECK(four.lm_head == alone.lm_head + 3 * kept);
  // Another rank and length count as that job's own.
  MemoryModelInputs mixed = one;
  mixed.group.push_back({"long", 2048, 8, 0.0, {"q_proj", "v_proj"}});
  const MemoryEstimate m = EstimateMemory(mixed, plan);
  CHECK(m.adapter ==
        alone.adapter +
            static_cast<uint64_t>(LoraParameterCount(one.config, 8, {"q_proj", "v_proj"})) * 16);
  CHECK(m.checkpoints == alone.checkpoints * 5);  // 512 + 2048 tokens

  // Refusals: the budget the first two jobs fit under their smallest plan, not the third.
  CHECK(GroupBudgetRefusal(group, ~uint64_t{0}, "first").empty());
  ResidencyPlan smallest = PlanFromSwapCount(16, 16, 1);
  smallest.head_streamed = true;
  MemoryModelInputs two = one;
  two.group.assign(group.group.begin(), group.group.begin() + 1);
  MemoryModelInputs three = two;
  three.group.push_back(group.group[1]);
  const uint64_t budget = EstimateMemory(two, smallest).total() + 1000;
  const uint64_t need = EstimateMemory(three, smallest).total();
  const std::string why = GroupBudgetRefusal(group, budget, "first");
  CHECK_THAT(why, Catch::Contains("job copy-1 does not fit") &&
                      Catch::Contains("beside the 2 before it") &&
                      Catch::Contains(std::to_string(need - budget) + " bytes"));
  CHECK_THAT(GroupBudgetRefusal(group, 1000, "first"), Catch::Contains("job first does not fit"));
}

TEST_CASE("a compressed store: blocks hold their compressed bytes and share one scratch",
          "[worker]") {
  MemoryModelInputs in = Inputs(16, 2048);
  const uint64_t expanded = in.block_bytes[0] - 4 * 4096;  // the projections in bf16
  const MemoryEstimate plain = EstimateMemory(in, PlanFromSwapCount(16, 12, 2));
  for (uint64_t& b : in.block_bytes) b = b / 2 + 4096;  // fp8-sized blocks
  in.expanded_bytes.assign(16, expanded);
  in.expanded_bytes[3] = expanded + 1;  // the scratch is the largest block's expansion
  const MemoryEstimate e = EstimateMemory(in, PlanFromSwapCount(16, 12, 2));
  // Four resident blocks and the slots hold compressed bytes; every use expands into the
  // one scratch.
  CHECK(e.resident_blocks == 4 * in.block_bytes[0]);
  CHECK(e.slot == in.block_bytes[0]);
  CHECK(e.ring == 2 * e.slot);
  CHECK(e.expansion == expanded + 1);
  CHECK(e.fixed() == plain.fixed() - plain.resident_blocks + e.resident_blocks + e.expansion);
  CHECK_THAT(e.Describe(), Catch::Contains("expansion scratch"));
  CHECK_THAT(plain.Describe(), !Catch::Contains("expansion scratch"));
  // Everything resident: sixteen compressed blocks and still one scratch.
  const MemoryEstimate all = EstimateMemory(in, PlanFromSwapCount(16, 0, 2));
  CHECK(all.resident_blocks == 16 * in.block_bytes[0]);
  CHECK(all.expansion == expanded + 1);
}

TEST_CASE("Qwen3-8B with NF4 blocks and an NF4 LM head trains at 2048 tokens within 3 GiB",
          "[worker]") {
  MemoryModelInputs in = InputsFor(Qwen3_8bShape(), 2048);
  in.fused_cross_entropy = true;  // CUDA, bf16
  const QuantInfo nf4 = StoreQuantFormat(QuantMethod::kNf4);
  const SegmentInfo block =
      LayoutSegment(in.config.BlockTensorShapes(), "", DType::kBF16, 256, nf4);
  in.block_bytes.assign(36, block.nbytes);
  in.expanded_bytes.assign(36, static_cast<uint64_t>(ExpandedElements(block)) * 2);
  const uint64_t gib = uint64_t{1} << 30;
  // The head in bf16 (1.16 GiB, streamed at its phase): every plan is above 3 GiB.
  CHECK_THROWS_WITH(PlanFromBudget(in, 3 * gib, 2), Catch::Contains("below the minimum"));
  // Compressed: 0.33 GiB and a slice scratch of tens of MiB.
  const SegmentInfo rest =
      LayoutSegment(in.config.RestTensorShapes(), "", DType::kBF16, 256, nf4, {"lm_head.weight"});
  const TensorSlice* head = rest.Find("lm_head.weight");
  in.head_bytes = CompressedSpanBytes(rest, *head);
  in.head_slice_rows = HeadSliceRows(151936, 4096, nf4);
  CHECK(in.head_slice_rows == 4096);  // 32 MiB of bf16 rows, a multiple of 4 (nf4 groups)
  CHECK(in.head_bytes < gib * 34 / 100);
  const ResidencyPlan plan = PlanFromBudget(in, 3 * gib, 2);
  const MemoryEstimate e = EstimateMemory(in, plan);
  CHECK(e.total() <= 3 * gib);
  CHECK(e.head_scratch == 4096ULL * 4096 * 2 + e.head_chunk_rows * (4096ULL * 2 + 4 * 4096));
  CHECK(e.head_scratch < (uint64_t{64} << 20));
  // fp8's head: slices of 128-row tiles.
  CHECK(HeadSliceRows(151936, 4096, StoreQuantFormat(QuantMethod::kFp8)) == 4096);
  // At least one group of rows (a tiny bound), at most the vocabulary.
  CHECK(HeadSliceRows(100000, 64, StoreQuantFormat(QuantMethod::kNf4), 1000) == 256);
  CHECK(HeadSliceRows(300, 64, StoreQuantFormat(QuantMethod::kNf4)) == 300);
}

TEST_CASE("a mixture of experts' tape holds its routed rows", "[worker]") {
  // Qwen3-30B-A3B's block: 128 experts of width 768, 8 per token; the taped block keeps each
  // routed row's gate, up and product (the dispatch width k x 768 per token) and its expert's
  // output before the routing weight (k x hidden), the router's f32 logits and the sorted
  // slots (int64 order and token per routed row).
  const ModelConfig c = Qwen3MoeShape(36);
  REQUIRE(c.is_moe());
  const MemoryModelInputs in = InputsFor(c, 2048);
  const MemoryEstimate e = EstimateMemory(in, PlanFromSwapCount(c.num_hidden_layers, 0, 1));
  const uint64_t t = 2048, b = 2, h = 2048, q = 4096, kv = 512, inter = 8 * 768;
  const uint64_t lora_pieces = t * b * 16 * 7;  // InputsFor's rank 16 on the 7 default targets
  REQUIRE(e.tape == t * b * (3 * h + 4 * q + 3 * kv + 3 * inter + 8 * h) + lora_pieces +
                        32 * t * 4 + (2 + 32 + 4) * t * 4 + t * (4 * 128 + 16 * 8));
  // The expert outputs alone are 64 MiB of the block's tape at 2048 tokens.
  REQUIRE(t * b * 8 * h == 64ULL << 20);
  // Its adapter (every expert's gate, up and down) is hundreds of millions of parameters: the
  // optimizer's scratch is its bound, not 4 bytes a parameter.
  REQUIRE(e.adapter / 16 * 4 > (uint64_t{1} << 30));
  REQUIRE(e.optimizer_scratch == kOptimizerScratchBytes);
  // Its bf16 copy, held through the forward, the LM head and the backward, is 2 bytes a
  // parameter plus q/k/v's A factors concatenated (the experts' are stacked as they are cast).
  const uint64_t params = static_cast<uint64_t>(LoraParameterCount(c, 16, in.lora_targets));
  REQUIRE(e.adapter_cast == (params + uint64_t(c.num_hidden_layers) * 16 * h * 3) * b);
  REQUIRE(e.head() >= e.fixed() + e.adapter_cast);
  REQUIRE(e.optimizer() < e.fixed() + e.adapter_cast);
}

TEST_CASE("a refusal names the adapter's state where it is most of the minimum", "[worker]") {
  // Half of the minimum or more: the bytes, and the keys that shrink them.
  MemoryEstimate e;
  e.adapter = 12ull << 30;
  e.adapter_cast = 1ull << 30;
  e.rest = 4ull << 30;
  REQUIRE(e.total() == 17ull << 30);
  const std::string hint = AdapterStateHint(e);
  CHECK(hint.find(std::to_string(13ull << 30) + " bytes (13.00 GiB) of it are the adapters'") !=
        std::string::npos);
  CHECK(hint.find("lora.rank or fewer lora.targets") != std::string::npos);
  // The 8-bit moments are named only where some job keeps f32 ones.
  CHECK(hint.find("adamw8bit") == std::string::npos);
  e.f32_moments = true;
  CHECK(AdapterStateHint(e).find("or optim.type = \"adamw8bit\"") != std::string::npos);
  // Less than half: nothing.
  e.rest = 14ull << 30;
  CHECK(AdapterStateHint(e).empty());
  CHECK(AdapterStateHint(MemoryEstimate{}).empty());
}

TEST_CASE(
    "8-bit moments: each A and B of 4096 elements or more at 10 bytes and 1/32, a "
    "group's jobs each their own",
    "[worker]") {
  // A tensor's state: f32 weight and gradient, and its moments: f32 under 4096 elements,
  // else a byte each over whole blocks of 256 plus an f32 maximum per block, twice.
  CHECK(AdapterStateBytes(4095, true) == 16 * 4095);
  CHECK(AdapterStateBytes(4096, true) == 8 * 4096 + 2 * (4096 + 16 * 4));
  CHECK(AdapterStateBytes(4097, true) == 8 * 4097 + 2 * (17 * 256 + 17 * 4));
  CHECK(AdapterStateBytes(4096, false) == 16 * 4096);
  // A dense model at rank 8 (hidden 4096: every A 8 x 4096, every B at least 8 x 1024).
  const ModelConfig c = Llama3_8bShape(4);
  MemoryModelInputs in = InputsFor(c, 512);
  in.lora_rank = 8;
  const ResidencyPlan plan = PlanFromSwapCount(c.num_hidden_layers, 0, 1);
  const MemoryEstimate f32 = EstimateMemory(in, plan);
  in.eight_bit_optimizer = true;
  const MemoryEstimate eight = EstimateMemory(in, plan);
  const uint64_t params = static_cast<uint64_t>(LoraParameterCount(c, 8, in.lora_targets));
  CHECK(f32.adapter == 16 * params);
  CHECK(f32.f32_moments);
  CHECK(eight.adapter == 8 * params + 2 * (params + params / 256 * 4));
  CHECK(!eight.f32_moments);
  // Its optimizer's temporaries: 32 bytes an element, at most kEightBitOptimizerScratchBytes.
  CHECK(eight.optimizer_scratch == std::min<uint64_t>(32 * params, kEightBitOptimizerScratchBytes));
  // In a group, each job's own kind of moments.
  in.group.push_back({"f32", 512, 8, 0.0, in.lora_targets, false});
  in.group.push_back({"8bit", 512, 8, 0.0, in.lora_targets, true});
  const MemoryEstimate group = EstimateMemory(in, plan);
  CHECK(group.adapter == 2 * eight.adapter + f32.adapter);
  CHECK(group.f32_moments);
}
