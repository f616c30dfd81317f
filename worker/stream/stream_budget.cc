#include "worker/stream/stream_budget.h"

#include <algorithm>
#include <cstdio>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"

namespace lorastream::worker {

uint64_t MemoryEstimate::fixed() const {
  return rest + (head_streamed ? 0 : head_weights) + resident_blocks + expansion + adapter +
         checkpoints + reserve;
}
uint64_t MemoryEstimate::forward() const {
  return fixed() + adapter_cast + forward_ring + forward_working + attention + taped_blocks * tape;
}
uint64_t MemoryEstimate::head() const {
  return fixed() + adapter_cast + std::max(ring, head_ring) + (head_streamed ? head_weights : 0) +
         lm_head + head_scratch + taped_blocks * tape;
}
uint64_t MemoryEstimate::backward() const {
  return fixed() + adapter_cast + backward_ring + block_working + attention +
         static_cast<uint64_t>(std::max(taped_blocks - 1, 0)) * tape;
}
uint64_t MemoryEstimate::optimizer() const { return fixed() + ring + optimizer_scratch; }
uint64_t MemoryEstimate::total() const {
  return std::max({forward(), head(), backward(), optimizer()});
}

std::string AdapterStateHint(const MemoryEstimate& minimum) {
  const uint64_t state = minimum.adapter + minimum.adapter_cast;
  if (state == 0 || state < minimum.total() / 2) return "";
  return "; " + std::to_string(state) + " bytes (" + FormatBytes(state, 2) +
         ") of it are the adapters' f32 weights, gradients and AdamW moments and their " +
         "compute-dtype copy, which only a lower lora.rank or fewer lora.targets shrink" +
         (minimum.f32_moments ? std::string(", or optim.type = \"adamw8bit\" (8-bit moments: "
                                            "about 10 bytes a parameter instead of 16)")
                              : std::string());
}

std::string MemoryEstimate::Describe() const {
  return FormatGiB(total(), 2) + " at the peak: rest " + FormatBytes(rest, 2) +
         " + LM head weights " + FormatBytes(head_weights, 2) +
         (head_streamed ? " (streamed: at the LM head only)" : " (resident)") +
         (head_scratch > 0 ? " + its slice expansion " + FormatBytes(head_scratch, 2)
                           : std::string()) +
         " + resident blocks " + FormatBytes(resident_blocks, 2) +
         (expansion > 0 ? " + expansion scratch " + FormatBytes(expansion, 2) : std::string()) +
         " + adapter&optimizer " + FormatBytes(adapter, 2) +
         (adapter_cast > 0 ? " (until the optimizer: its compute-dtype copy " +
                                 FormatBytes(adapter_cast, 2) + ")"
                           : std::string()) +
         " + checkpoints " + FormatBytes(checkpoints, 2) + " + reserve " + FormatBytes(reserve, 2) +
         ", then: forward " + FormatBytes(forward(), 2) + " (slots " +
         FormatBytes(forward_ring, 2) + ", working " + FormatBytes(forward_working, 2) +
         ", attention " + FormatBytes(attention, 2) + "), LM head " + FormatBytes(head(), 2) +
         " (slots " + FormatBytes(std::max(ring, head_ring), 2) + ", chunked lm head " +
         FormatBytes(lm_head, 2) + " in chunks of " + std::to_string(head_chunk_rows) + " rows" +
         "), backward " + FormatBytes(backward(), 2) + " (slots " + FormatBytes(backward_ring, 2) +
         ", block working set " + FormatBytes(block_working, 2) + ", attention " +
         FormatBytes(attention, 2) + ")" +
         (taped_blocks > 0
              ? ", " + std::to_string(taped_blocks) + " taped blocks of " + FormatBytes(tape, 2)
              : std::string()) +
         ", optimizer " + FormatBytes(optimizer(), 2) + " (its scratch " +
         FormatBytes(optimizer_scratch, 2) + "); peak " + FormatBytes(total(), 2);
}

uint64_t AutoMemoryBudget(uint64_t free_bytes) {
  return static_cast<uint64_t>(static_cast<double>(free_bytes) * kAutoBudgetFraction);
}

void SetNonBlockBytes(MemoryModelInputs* in) {
  const uint64_t b = static_cast<uint64_t>(in->compute_bytes);
  const uint64_t h = static_cast<uint64_t>(in->config.hidden_size);
  in->rest_bytes = h * b;
  in->head_bytes = static_cast<uint64_t>(in->config.vocab_size) * h * b;
}

namespace {

// Calls fn(in, out, copies) for each targeted projection of one block (`copies`: a mixture's
// experts each have one).
template <class Fn>
void ForEachLoraProjection(const ModelConfig& c, const std::vector<std::string>& targets,
                           const Fn& fn) {
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  const int64_t h = c.hidden_size;
  // A mixture of experts' MLP targets are every expert's (mixtral's w1, w3, w2 the same).
  const int64_t inter = c.is_moe() ? c.moe_intermediate_size : c.intermediate_size;
  const int64_t copies = c.is_moe() ? c.num_experts : 1;
  std::vector<std::string> names;
  for (const std::string& t : targets) {
    if (t == "experts") {
      names.insert(names.end(), {"gate_proj", "up_proj", "down_proj"});
    } else {
      names.push_back(t == "w1"   ? "gate_proj"
                      : t == "w3" ? "up_proj"
                      : t == "w2" ? "down_proj"
                                  : t);
    }
  }
  for (const std::string& t : names) {
    int64_t in = 0, out = 0, n = 1;
    if (t == "q_proj") {
      in = h;
      out = q;
    } else if (t == "k_proj" || t == "v_proj") {
      in = h;
      out = kv;
    } else if (t == "o_proj") {
      in = q;
      out = h;
    } else if (t == "gate_proj" || t == "up_proj") {
      in = h;
      out = inter;
      n = copies;
    } else if (t == "down_proj") {
      in = inter;
      out = h;
      n = copies;
    } else {
      throw Error(ErrorCode::kRefused, "lora.targets: unknown target module `" + t +
                                           "` (known: q_proj k_proj v_proj o_proj gate_proj "
                                           "up_proj down_proj; experts, w1, w3, w2)");
    }
    fn(in, out, n);
  }
}

}  // namespace

int64_t LoraParameterCount(const ModelConfig& c, int64_t rank,
                           const std::vector<std::string>& targets) {
  int64_t per_block = 0;
  ForEachLoraProjection(c, targets, [&](int64_t in, int64_t out, int64_t copies) {
    per_block += copies * rank * (in + out);
  });
  return per_block * c.num_hidden_layers;
}

uint64_t LoraStateBytes(const ModelConfig& c, int64_t rank, const std::vector<std::string>& targets,
                        bool eight_bit) {
  uint64_t per_block = 0;
  ForEachLoraProjection(c, targets, [&](int64_t in, int64_t out, int64_t copies) {
    // A (rank x in) and B (out x rank), each a tensor of its own.
    per_block += static_cast<uint64_t>(copies) *
                 (AdapterStateBytes(static_cast<uint64_t>(rank * in), eight_bit) +
                  AdapterStateBytes(static_cast<uint64_t>(rank * out), eight_bit));
  });
  return per_block * static_cast<uint64_t>(c.num_hidden_layers);
}

namespace {

// The A factors a block's compute-dtype adapter holds twice (CastLoraBlock): those of q, k
// and v, and of a dense MLP's gate and up, concatenated per group where two or more of the
// group are adapted; over every block.
uint64_t StackedACount(const ModelConfig& c, int64_t rank,
                       const std::vector<std::string>& targets) {
  const auto has = [&targets](const char* name) {
    return std::find(targets.begin(), targets.end(), name) != targets.end();
  };
  const int qkv = has("q_proj") + has("k_proj") + has("v_proj");
  const int gate_up = c.is_moe() ? 0 : has("gate_proj") + has("up_proj");
  const uint64_t per_group = static_cast<uint64_t>(rank) * static_cast<uint64_t>(c.hidden_size);
  return static_cast<uint64_t>(c.num_hidden_layers) * per_group *
         static_cast<uint64_t>((qkv >= 2 ? qkv : 0) + (gate_up >= 2 ? gate_up : 0));
}

}  // namespace

MemoryEstimate EstimateMemory(const MemoryModelInputs& in, const ResidencyPlan& plan) {
  const ModelConfig& c = in.config;
  LS_CHECK(static_cast<int>(in.block_bytes.size()) == plan.num_blocks(),
           "block sizes and plan disagree on the number of blocks");
  const uint64_t b = static_cast<uint64_t>(in.compute_bytes);
  const uint64_t h = c.hidden_size;
  // A mixture of experts: each token's MLP activations are its top-k experts' (the dispatch
  // buffers: tokens x top-k rows of the expert width), and each routed row also gathers its
  // input and keeps its expert's output (2 x hidden per routed row, in `routed`).
  const uint64_t k = c.is_moe() ? static_cast<uint64_t>(c.num_experts_per_tok) : 0;
  const uint64_t inter = c.is_moe() ? k * static_cast<uint64_t>(c.moe_intermediate_size)
                                    : static_cast<uint64_t>(c.intermediate_size);
  const uint64_t routed = 2 * k * h + (c.is_moe() ? static_cast<uint64_t>(c.num_experts) : 0);
  const uint64_t q = c.num_attention_heads * c.head_dim;
  const uint64_t kv = c.num_key_value_heads * c.head_dim;
  const uint64_t heads = c.num_attention_heads;

  MemoryEstimate e;
  e.rest = in.rest_bytes;
  uint64_t largest_streamed = 0;
  for (int i = 0; i < plan.num_blocks(); ++i) {
    // A compressed block holds its compressed bytes, resident or in a slot; its uses share
    // one expansion scratch.
    if (!in.expanded_bytes.empty()) e.expansion = std::max(e.expansion, in.expanded_bytes[i]);
    if (plan.streamed[i])
      largest_streamed = std::max(largest_streamed, in.block_bytes[i]);
    else
      e.resident_blocks += in.block_bytes[i];
  }
  e.slot = largest_streamed;
  e.ring = static_cast<uint64_t>(plan.ring_size) * largest_streamed;
  e.forward_ring = static_cast<uint64_t>(plan.forward_slots) * largest_streamed;
  e.backward_ring = static_cast<uint64_t>(plan.backward_slots) * largest_streamed;
  e.head_ring = static_cast<uint64_t>(plan.head_slots) * largest_streamed;
  // One job's share of the activations and its adapter; a group's are summed.
  uint64_t head_chunk = 0, head_kept = 0;
  auto add_job = [&](int64_t tokens, int64_t rank, double lora_dropout,
                     const std::vector<std::string>& targets, bool eight_bit) {
    const uint64_t t = static_cast<uint64_t>(std::max<int64_t>(tokens, 0));
    e.forward_working += t * b * (4 * h + q + 2 * kv + 3 * inter);
    const uint64_t params = static_cast<uint64_t>(LoraParameterCount(c, rank, targets));
    e.adapter += LoraStateBytes(c, rank, targets, eight_bit);
    if (!eight_bit) e.f32_moments = true;
    // Each block's adapter in the compute dtype (CastLoraBlock, worker/model/block.h), held
    // from the block's forward to its backward: every block's from the forward's end to the
    // backward's start. None where the compute dtype is the adapter's own (f32).
    if (b != 4) e.adapter_cast += (params + StackedACount(c, rank, targets)) * b;
    e.optimizer_scratch = std::max(e.optimizer_scratch,
                                   std::min(params * (eight_bit ? kEightBitScratchPerElement : 4),
                                            OptimizerScratchBytes(eight_bit)));
    e.checkpoints += static_cast<uint64_t>(plan.num_blocks()) * t * h * b;
    // LoRA dropout keeps each adapted projection's dropped input and its mask.
    uint64_t dropout = 0;
    if (lora_dropout > 0) {
      for (const std::string& target : targets)
        dropout += t * (b + 1) * (target == "o_proj" ? q : target == "down_proj" ? inter : h);
    }
    const uint64_t lora_pieces = t * b * static_cast<uint64_t>(rank) * targets.size();
    e.block_working +=
        t * b * (8 * h + 4 * (q + 2 * kv) + 6 * inter + routed) + 2 * lora_pieces + dropout;
    // attention's saved probabilities where it materialises them, else its logsumexp.
    // A mixture of experts' tape also keeps each routed row's expert output before its
    // routing weight (k x hidden per token), the router's f32 logits and the sorted slots'
    // order and tokens (int64).
    const uint64_t experts = c.is_moe() ? static_cast<uint64_t>(c.num_experts) : 0;
    e.tape += t * b * (3 * h + 4 * q + 3 * kv + 3 * inter + k * h) + lora_pieces +
              (in.attention_materialized ? heads * t * t * b : heads * t * 4) +
              (2 + heads + static_cast<uint64_t>(c.num_key_value_heads)) * t * 4 +
              t * (4 * experts + 16 * k) + dropout;
    e.attention += in.attention_materialized ? heads * t * t * b * 2 : heads * t * 4;
    const int64_t chunk_rows = HeadChunkRows(tokens, c.vocab_size, c.hidden_size,
                                             in.head_chunk_bytes, in.fused_cross_entropy);
    head_chunk = std::max(
        head_chunk, static_cast<uint64_t>(chunk_rows) *
                        HeadChunkRowBytes(c.vocab_size, c.hidden_size, in.fused_cross_entropy));
    head_kept += 2 * t * h * b;
    return chunk_rows;
  };
  e.head_chunk_rows =
      add_job(in.tokens, in.lora_rank, in.lora_dropout, in.lora_targets, in.eight_bit_optimizer);
  for (const MemoryModelInputs::GroupMember& m : in.group)
    add_job(m.tokens, m.lora_rank, m.lora_dropout, m.lora_targets, m.eight_bit_optimizer);
  e.taped_blocks = plan.taped_blocks;
  e.head_weights = in.head_bytes;
  e.head_streamed = plan.head_streamed;
  e.lm_head = head_chunk + head_kept;
  if (in.head_slice_rows > 0) {
    const uint64_t s = static_cast<uint64_t>(in.head_slice_rows);
    e.head_scratch =
        s * h * (b + (b != 2 ? 2 : 0)) + static_cast<uint64_t>(e.head_chunk_rows) * (s * b + 4 * h);
  }
  e.reserve = in.reserve_bytes;
  return e;
}

std::string GroupBudgetRefusal(const MemoryModelInputs& inputs, uint64_t budget_bytes,
                               const std::string& first_name) {
  ResidencyPlan smallest = PlanFromSwapCount(static_cast<int>(inputs.block_bytes.size()),
                                             static_cast<int>(inputs.block_bytes.size()), 1);
  smallest.head_streamed = inputs.head_bytes > 0;
  MemoryModelInputs prefix = inputs;
  prefix.group.clear();
  for (size_t j = 0; j <= inputs.group.size(); ++j) {
    if (j > 0) prefix.group.push_back(inputs.group[j - 1]);
    const uint64_t peak = EstimateMemory(prefix, smallest).total();
    if (peak <= budget_bytes) continue;
    const std::string name = j == 0 ? first_name : inputs.group[j - 1].name;
    return "job " + name + " does not fit in the group" +
           (j == 0 ? std::string() : " beside the " + std::to_string(j) + " before it") +
           ": the group's smallest plan (every block streamed, ring 1, LM head streamed) needs " +
           FormatBytes(peak, 2) + ", " + FormatBytes(peak - budget_bytes, 2) + " (" +
           std::to_string(peak - budget_bytes) + " bytes) more than the budget of " +
           FormatBytes(budget_bytes, 2);
  }
  return "";
}

ResidencyPlan FillTapedBlocks(const MemoryModelInputs& in, ResidencyPlan plan,
                              uint64_t peak_bytes) {
  while (plan.taped_blocks < plan.num_blocks()) {
    ResidencyPlan more = plan;
    ++more.taped_blocks;
    if (EstimateMemory(in, more).total() > peak_bytes) break;
    plan = more;
  }
  return plan;
}

ResidencyPlan FillPhaseSlots(const MemoryModelInputs& in, ResidencyPlan plan, uint64_t peak_bytes) {
  // Each phase's estimate grows with its own slots only.
  while (plan.forward_slots < plan.num_streamed()) {
    ResidencyPlan more = plan;
    ++more.forward_slots;
    if (EstimateMemory(in, more).forward() > peak_bytes) break;
    plan = more;
  }
  while (plan.backward_slots < plan.num_streamed()) {
    ResidencyPlan more = plan;
    ++more.backward_slots;
    if (EstimateMemory(in, more).backward() > peak_bytes) break;
    plan = more;
  }
  return FillHeadSlots(in, plan, peak_bytes);
}

ResidencyPlan FillHeadSlots(const MemoryModelInputs& in, ResidencyPlan plan, uint64_t peak_bytes) {
  plan.head_slots = std::max(plan.head_slots, plan.ring_size);
  while (plan.head_slots < plan.backward_slots) {
    ResidencyPlan more = plan;
    ++more.head_slots;
    if (EstimateMemory(in, more).head() > peak_bytes) break;
    plan = more;
  }
  // A streamed head is copied into the forward's slots once the forward has freed enough of
  // them (its phase estimate holds its slots; the head takes their place).
  plan.head_prefetch_slots = 0;
  const uint64_t slot = EstimateMemory(in, plan).slot;
  if (plan.head_streamed && slot > 0) {
    const int need = static_cast<int>((in.head_bytes + slot - 1) / slot);
    if (plan.forward_slots - plan.head_boundary_slots() >= need) plan.head_prefetch_slots = need;
  }
  return plan;
}

ResidencyPlan PlanFromBudget(const MemoryModelInputs& in, uint64_t budget_bytes, int ring_size) {
  RequireValidRingSize(ring_size);
  const int num_blocks = static_cast<int>(in.block_bytes.size());
  // The estimate grows with every resident block, so the largest fitting count is found by
  // walking down from all-resident; L is small (tens), so no bisection is needed. The LM
  // head is streamed only when no plan fits with it resident.
  for (bool head_streamed : {false, true}) {
    for (int resident = num_blocks; resident >= 0; --resident) {
      ResidencyPlan plan = PlanFromSwapCount(num_blocks, num_blocks - resident, ring_size);
      plan.head_streamed = head_streamed;
      MemoryEstimate e = EstimateMemory(in, plan);
      if (e.total() <= budget_bytes) {
        plan = FillPhaseSlots(in, plan, budget_bytes);
        e = EstimateMemory(in, plan);
        LS_LOG_INFO("stream plan from gpu_memory_budget {}: {}; estimate {}",
                    FormatBytes(budget_bytes, 2), plan.Describe(), e.Describe());
        return plan;
      }
      if (resident == 0 && head_streamed) {
        throw Error(ErrorCode::kRefused,
                    "stream.gpu_memory_budget " + std::to_string(budget_bytes) + " bytes (" +
                        FormatBytes(budget_bytes, 2) + ") is below the minimum of " +
                        std::to_string(e.total()) + " bytes (" + FormatBytes(e.total(), 2) +
                        ") needed with every block streamed through " +
                        std::to_string(plan.ring_size) + " slots and the LM head streamed (" +
                        e.Describe() + "): raise gpu_memory_budget to at least " +
                        std::to_string(e.total()) + ", or lower ring_size, seq_len or batch_size" +
                        AdapterStateHint(e));
      }
    }
  }
  LS_CHECK(false, "unreachable");
  return {};
}

}  // namespace lorastream::worker
