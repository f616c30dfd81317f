#include "worker/stream_budget.h"

#include <algorithm>
#include <cstdio>

#include "common/error.h"
#include "common/format_bytes.h"
#include "common/log.h"

namespace lorastream {

uint64_t MemoryEstimate::total() const {
  return rest + resident_blocks + ring + adapter + checkpoints + block_working + attention +
         lm_head + reserve;
}

std::string MemoryEstimate::Describe() const {
  return "rest " + FormatBytes(rest, 2) + " + resident blocks " + FormatBytes(resident_blocks, 2) +
         " + ring " + FormatBytes(ring, 2) + " + adapter&optimizer " + FormatBytes(adapter, 2) +
         " + checkpoints " + FormatBytes(checkpoints, 2) + " + block working set " +
         FormatBytes(block_working, 2) + " + attention " + FormatBytes(attention, 2) +
         " + lm head " + FormatBytes(lm_head, 2) + " + reserve " + FormatBytes(reserve, 2) + " = " +
         FormatBytes(total(), 2);
}

int64_t LoraParameterCount(const ModelConfig& c, int64_t rank,
                           const std::vector<std::string>& targets) {
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  int64_t per_block = 0;
  for (const std::string& t : targets) {
    int64_t in = 0, out = 0;
    if (t == "q_proj") { in = h; out = q; }
    else if (t == "k_proj" || t == "v_proj") { in = h; out = kv; }
    else if (t == "o_proj") { in = q; out = h; }
    else if (t == "gate_proj" || t == "up_proj") { in = h; out = inter; }
    else if (t == "down_proj") { in = inter; out = h; }
    else {
      throw Error(ErrorCode::kRefused, "lora.targets: unknown target module `" + t +
                                           "` (known: q_proj k_proj v_proj o_proj gate_proj "
                                           "up_proj down_proj)");
    }
    per_block += rank * (in + out);
  }
  return per_block * c.num_hidden_layers;
}

MemoryEstimate EstimateMemory(const MemoryModelInputs& in, const ResidencyPlan& plan) {
  const ModelConfig& c = in.config;
  LS_CHECK(static_cast<int>(in.block_bytes.size()) == plan.num_blocks(),
           "block sizes and plan disagree on the number of blocks");
  const uint64_t t = static_cast<uint64_t>(std::max<int64_t>(in.tokens, 0));
  const uint64_t b = static_cast<uint64_t>(in.compute_bytes);
  const uint64_t h = c.hidden_size, inter = c.intermediate_size, v = c.vocab_size;
  const uint64_t q = c.num_attention_heads * c.head_dim;
  const uint64_t kv = c.num_key_value_heads * c.head_dim;
  const uint64_t heads = c.num_attention_heads;

  MemoryEstimate e;
  e.rest = in.rest_bytes;
  uint64_t largest_streamed = 0;
  for (int i = 0; i < plan.num_blocks(); ++i) {
    if (plan.streamed[i]) {
      largest_streamed = std::max(largest_streamed, in.block_bytes[i]);
    } else {
      e.resident_blocks += in.block_bytes[i];
    }
  }
  e.ring = static_cast<uint64_t>(plan.ring_size) * largest_streamed;
  e.adapter = static_cast<uint64_t>(LoraParameterCount(c, in.lora_rank, in.lora_targets)) * 16;
  e.checkpoints = static_cast<uint64_t>(plan.num_blocks()) * t * h * b;
  e.block_working = t * b * (8 * h + 4 * (q + 2 * kv) + 6 * inter) +
                    t * b * static_cast<uint64_t>(in.lora_rank) * 2 * in.lora_targets.size();
  e.attention = in.attention_materialized ? heads * t * t * b * 2 : heads * t * 4;
  e.lm_head = t * v * (b + 8);
  e.reserve = in.reserve_bytes;
  return e;
}

ResidencyPlan PlanFromBudget(const MemoryModelInputs& in, uint64_t budget_bytes,
                             int ring_size) {
  RequireValidRingSize(ring_size);
  const int num_blocks = static_cast<int>(in.block_bytes.size());
  // The estimate grows with every resident block, so the largest fitting count is found by
  // walking down from all-resident; L is small (tens), so no bisection is needed.
  for (int resident = num_blocks; resident >= 0; --resident) {
    ResidencyPlan plan = PlanFromSwapCount(num_blocks, num_blocks - resident, ring_size);
    const MemoryEstimate e = EstimateMemory(in, plan);
    if (e.total() <= budget_bytes) {
      LS_LOG_INFO("stream plan from gpu_memory_budget {}: {}; estimate {}",
                  FormatBytes(budget_bytes, 2), plan.Describe(), e.Describe());
      return plan;
    }
    if (resident == 0) {
      throw Error(ErrorCode::kRefused,
                  "stream.gpu_memory_budget " + std::to_string(budget_bytes) + " bytes (" +
                      FormatBytes(budget_bytes, 2) + ") is below the minimum of " +
                      std::to_string(e.total()) + " bytes (" + FormatBytes(e.total(), 2) +
                      ") needed with every block streamed through " +
                      std::to_string(plan.ring_size) + " slots (" + e.Describe() +
                      "): raise gpu_memory_budget to at least " + std::to_string(e.total()) +
                      ", or lower ring_size, seq_len or batch_size");
    }
  }
  LS_CHECK(false, "unreachable");
  return {};
}

}  // namespace lorastream
