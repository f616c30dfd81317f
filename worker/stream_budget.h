// Plans the resident/streamed split from a GPU memory budget (torch-free): the largest set of
// resident blocks that fits together with the ring, the non-block weights, the adapter with
// its optimizer state and an estimate of the activations.
//
// The estimate, per micro-batch of T tokens (b = bytes per element of the compute dtype,
// H = hidden, Q = heads x head_dim, KV = kv heads x head_dim, I = intermediate, V = vocab):
//   weights        rest segment + resident blocks + R x (largest streamed block)
//   adapter        P x 16 bytes: fp32 master weights, fp32 grads, two fp32 Adam moments
//                  (P = rank x (in + out) summed over the targeted projections of all blocks)
//   checkpoints    L x T x H x b: each block's input, kept by gradient checkpointing
//   block working  T x b x (8 H + 4 (Q + 2 KV) + 6 I): one block recomputed with grad and
//                  its backward (norm outputs, q/k/v, attention output, gate/up/act/product,
//                  and the gradients flowing through them), plus LoRA's T x rank pieces
//   attention      heads x T x T x b x 2 (scores and probabilities) where attention
//                  materialises them (no fused kernel); else heads x T x 4 (logsumexp)
//   lm head        T x V x (b + 8): logits, their fp32 copy and the fp32 gradient
//   reserve        fixed slack for allocator fragmentation and small tensors
// It is an estimate: the benchmark prints the measured peak next to it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "worker/stream_plan.h"

namespace lorastream {

struct MemoryModelInputs {
  ModelConfig config;
  std::vector<uint64_t> block_bytes;  // bytes of each block as stored (and copied)
  uint64_t rest_bytes = 0;            // non-block weights kept on the device
  int64_t lora_rank = 16;
  std::vector<std::string> lora_targets = {"q_proj", "k_proj",    "v_proj",  "o_proj",
                                           "gate_proj", "up_proj", "down_proj"};
  int64_t tokens = 0;                 // batch_size x seq_len of one micro-batch
  int compute_bytes = 2;              // 2: bf16 compute; 4: f32
  bool attention_materialized = false;  // true where attention has no fused kernel
  uint64_t reserve_bytes = uint64_t{512} << 20;  // allocator slack; lower = tighter plans
};

struct MemoryEstimate {
  uint64_t rest = 0, resident_blocks = 0, ring = 0, adapter = 0, checkpoints = 0,
           block_working = 0, attention = 0, lm_head = 0, reserve = 0;
  uint64_t total() const;
  std::string Describe() const;  // "rest 2.1 GB + resident 4 x 436 MB + ..."
};

// The number of LoRA parameters (A and B of every targeted projection of every block).
int64_t LoraParameterCount(const ModelConfig& config, int64_t rank,
                           const std::vector<std::string>& targets);

MemoryEstimate EstimateMemory(const MemoryModelInputs& inputs, const ResidencyPlan& plan);

// The plan with the most resident blocks whose estimate fits `budget_bytes` (resident blocks
// spread as PlanFromSwapCount spreads them). Refuses (kRefused) a budget below the minimum
// (every block streamed), saying how many bytes that minimum is. Logs the plan and estimate.
ResidencyPlan PlanFromBudget(const MemoryModelInputs& inputs, uint64_t budget_bytes,
                             int ring_size);

}  // namespace lorastream
