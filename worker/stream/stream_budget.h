// Plans the resident/streamed split from a GPU memory budget (torch-free): the largest set of
// resident blocks that fits together with the ring, the non-block weights, the adapter with
// its optimizer state and an estimate of the activations.
//
// The estimate, per micro-batch of T tokens (for a job group: each job's terms with its own T,
// rank and targets, summed; MemoryModelInputs::group) (b = bytes per element of the compute dtype,
// H = hidden, Q = heads x head_dim, KV = kv heads x head_dim, I = intermediate, V = vocab):
//   weights        rest (the final norm) + LM head (V x H x b, or a compressed head's bytes:
//                  resident, for the whole step; streamed, during the LM head only) +
//                  resident blocks + R x (largest streamed block). The embedding table
//                  stays in host RAM: only the batch's rows (T x H x b) are copied to the
//                  device.
//   adapter        P x 16 bytes: fp32 master weights, fp32 grads, two fp32 Adam moments
//                  (P = rank x (in + out) summed over the targeted projections of all blocks);
//                  with 8-bit moments (optim.type = "adamw8bit") about P x 10: each A or B of
//                  at least kEightBitMinElements elements AdapterStateBytes
//   adapter cast   (P + A') x b where b < 4: each block's adapter in the compute dtype, made
//                  at its forward and held to its backward (A' = the A factors of q/k/v and of
//                  a dense MLP's gate/up, concatenated once more where two or more of a group
//                  are adapted); in the forward, LM head and backward phases
//   checkpoints    L x T x H x b: each block's input, kept by gradient checkpointing
//   block working  T x b x (8 H + 4 (Q + 2 KV) + 6 I): one block recomputed with grad and
//                  its backward (norm outputs, q/k/v, attention output, gate/up/act/product,
//                  and the gradients flowing through them), plus LoRA's T x rank pieces
//                  (and LoRA dropout's, below)
//   attention      heads x T x T x b x 2 (scores and probabilities) where attention
//                  materialises them (no fused kernel); else heads x T x 4 (logsumexp)
//   lm head        the chunked head (worker/model/lm_head.h): one chunk of C rows at a time,
//                  C x (8 V + 16 H) (its f32 logits and log-probabilities, the final norm's
//                  saved tensors; with the fused cross entropy C x (2 V + 16 H + 4): the
//                  compute-dtype logits, overwritten by their gradient, and a loss per
//                  row), C = HeadChunkRows(T, V, H, head_chunk_bytes); plus
//                  2 x T x H x b (the last hidden state and its gradient, kept into the
//                  backward). Never the whole sequence's T x V logits.
//   forward working  T x b x (4 H + Q + 2 KV + 3 I): one block's forward without grad
//   tape           T x b x (3 H + 4 Q + 3 KV + 3 I + rank x targets) + T x 4 x (2 + heads +
//                  kv heads) + heads x T x 4 (heads x T x T x b where attention
//                  materialises its probabilities): the activations a taped block keeps
//                  from its forward into its backward (norm outputs and their 1/rms, q/k/v
//                  and, where the model normalises them, q/k before that, attention's output
//                  and what its backward saves, o_proj's input, gate/up/product, LoRA's
//                  T x rank pieces)
//   dropout        with LoRA dropout, T x (b + 1) x (sum of the targets' input widths): each
//                  adapted projection's dropped input and its mask, in the block working set
//                  and in a tape
//   reserve        fixed slack for allocator fragmentation and small tensors
//   optimizer      min(4 P, kOptimizerScratchBytes): AdamW's sqrt(v) over one run of
//                  parameters; with 8-bit moments min(32 P, kEightBitOptimizerScratchBytes)
//                  (a group's jobs step one after another: the largest job's)
// The step's memory is a timeline of four phases, and the peak is the largest of them
// (fixed = rest + resident LM head + resident blocks + adapter + checkpoints + reserve):
//   forward    fixed + adapter cast + forward_slots x slot + forward working + attention +
//              K tapes
//   LM head    fixed + adapter cast + head_slots x slot + streamed LM head + lm head + K tapes
//              (the forward's last blocks wait in their slots; the backward's first blocks
//              are copied into the others)
//   backward   fixed + adapter cast + backward_slots x slot + block working + attention +
//              (K - 1) tapes
//   optimizer  fixed + R x slot + optimizer (the activations are gone; the ring's R slots stay)
// where K = taped_blocks (the first backward block's tape is part of its working set).
// It is an estimate: the benchmark prints the measured peak next to it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/model_config.h"
#include "common/formats/quant_format.h"
#include "worker/model/head_rows.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker {

// The trainer's AdamW (worker/train/adamw.h) updates its parameters in runs whose temporaries
// hold at most this many bytes: with f32 moments (sqrt(v), 4 bytes per element), and with
// 8-bit moments (kEightBitScratchPerElement: the gradients gathered, both moments in f32, the
// update and the rounding's indices).
inline constexpr uint64_t kOptimizerScratchBytes = uint64_t{64} << 20;
inline constexpr uint64_t kEightBitOptimizerScratchBytes = uint64_t{256} << 20;
inline constexpr uint64_t kEightBitScratchPerElement = 32;
inline constexpr uint64_t OptimizerScratchBytes(bool eight_bit) {
  return eight_bit ? kEightBitOptimizerScratchBytes : kOptimizerScratchBytes;
}
// 8-bit moments (AdamW8bit, bitsandbytes' blockwise form): one byte per element and one f32
// absolute maximum per block of kEightBitBlock elements, for parameters of at least
// kEightBitMinElements elements; smaller ones keep f32 moments.
inline constexpr int64_t kEightBitBlock = 256;
inline constexpr int64_t kEightBitMinElements = 4096;
// Device bytes of one LoRA tensor of `n` elements with its training state: f32 weight, f32
// gradient and AdamW's two moments (f32, or 8-bit as above).
inline constexpr uint64_t AdapterStateBytes(uint64_t n, bool eight_bit) {
  if (!eight_bit || n < static_cast<uint64_t>(kEightBitMinElements)) return 16 * n;
  const uint64_t blocks = (n + kEightBitBlock - 1) / kEightBitBlock;
  return 8 * n + 2 * (blocks * kEightBitBlock + 4 * blocks);
}

struct MemoryModelInputs {
  ModelConfig config;
  std::vector<uint64_t> block_bytes;  // bytes of each block as stored (and copied)
  // Of a compressed store: bytes of each block's expanded projections in the compute dtype
  // (worker/quant_expand.h). Every block stays compressed, resident or in its slot; its uses
  // expand into one scratch of the largest (the engine's). Empty: nothing is compressed.
  std::vector<uint64_t> expanded_bytes;
  uint64_t rest_bytes = 0;  // non-block weights always on the device (final norm)
  uint64_t head_bytes = 0;  // the LM head's weights on the device (V x H x b, or compressed)
  // A compressed head (a store's --quantize-head): rows per vocabulary slice (HeadSliceRows),
  // each expanded into one scratch during the LM head phase; 0: a plain head.
  int64_t head_slice_rows = 0;
  // The chunked head's bound on one chunk's working set (HeadChunkRows): lower = less memory
  // at the LM head, more (smaller) matmuls.
  uint64_t head_chunk_bytes = kDefaultHeadChunkBytes;
  // The head's loss runs as the fused kernel (FusedCrossEntropyApplies): rows are smaller.
  bool fused_cross_entropy = false;
  int64_t lora_rank = 16;
  double lora_dropout = 0;  // > 0: each adapted projection keeps its dropped input and mask
  std::vector<std::string> lora_targets = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                           "gate_proj", "up_proj", "down_proj"};
  int64_t tokens = 0;                            // batch_size x seq_len of one micro-batch
  int compute_bytes = 2;                         // 2: bf16 compute; 4: f32
  bool attention_materialized = false;           // true where attention has no fused kernel
  bool eight_bit_optimizer = false;              // optim.type = "adamw8bit": 8-bit moments
  uint64_t reserve_bytes = uint64_t{512} << 20;  // allocator slack; lower = tighter plans
  // A job group (worker/train/group_trainer.h): the other jobs beside the one above. Each
  // adds its own adapter and optimizer state, checkpoints, working sets, attention, tapes and
  // the LM head's kept states (its tokens' share of every row-wise term: the group's blocks
  // run over all jobs' rows at once; its head's chunks run after the others', so only the
  // largest chunk counts); the weights, slots and reserve are the group's, once.
  struct GroupMember {
    std::string name;  // the job's, for refusals
    int64_t tokens = 0;
    int64_t lora_rank = 16;
    double lora_dropout = 0;
    std::vector<std::string> lora_targets;
    bool eight_bit_optimizer = false;
  };
  std::vector<GroupMember> group;
};

struct MemoryEstimate {
  uint64_t rest = 0, resident_blocks = 0, ring = 0, adapter = 0, checkpoints = 0, block_working = 0,
           attention = 0, lm_head = 0, reserve = 0;
  uint64_t expansion = 0;  // a compressed store's one expansion scratch (its largest block's)
  uint64_t forward_ring = 0, head_ring = 0, backward_ring = 0, forward_working = 0;
  uint64_t tape = 0;               // one taped block's activations
  uint64_t optimizer_scratch = 0;  // the optimizer step's temporaries
  uint64_t adapter_cast = 0;       // every block's adapter in the compute dtype (not f32)
  bool f32_moments = false;        // some job's AdamW keeps f32 moments (not 8-bit)
  int taped_blocks = 0;
  uint64_t slot = 0;          // one slot: the largest streamed block (0: none streams)
  uint64_t head_weights = 0;  // the LM head's weights (in fixed, or in head() when streamed)
  // A compressed head's slice expansion during the LM head: the slice (and its bf16 staging
  // for another compute dtype), one chunk's slice of logits, its f32 gradient sum.
  uint64_t head_scratch = 0;
  bool head_streamed = false;
  int64_t head_chunk_rows = 0;  // the chunked head's rows per chunk
  uint64_t fixed() const;
  uint64_t forward() const;
  uint64_t head() const;
  uint64_t backward() const;
  uint64_t optimizer() const;
  uint64_t total() const;        // the peak: the largest phase
  std::string Describe() const;  // "rest 2.1 GB + resident 4 x 436 MB + ..."
};

// What a refusal below a plan's minimum adds when the adapters' state (their f32 weights,
// gradients and AdamW moments, and their compute-dtype copy) is half of that minimum or more,
// as rank 16 on every expert of a mixture makes it: "; N bytes (X GiB) of it are ..., which
// only a lower lora.rank or fewer lora.targets shrink". Empty otherwise: then streaming and
// shorter rows are what a smaller budget takes.
std::string AdapterStateHint(const MemoryEstimate& minimum);

// `gpu_memory_budget = "auto"` on a GPU: this fraction of the bytes free on it when the job
// starts (AutoMemoryBudget). The rest is left for what the estimate's reserve does not cover
// (another process's growth, the CUDA libraries' own allocations).
inline constexpr double kAutoBudgetFraction = 0.9;
uint64_t AutoMemoryBudget(uint64_t free_bytes);

// rest_bytes and head_bytes of `in` from its config and compute_bytes: the final norm, and the
// LM head (V x H in the compute dtype, tied or not: a tied head is the embedding table, which
// otherwise stays in host RAM and is not counted). A compressed head's bytes and slices are
// MemoryInputsFor's (worker/stream/stream_engine.h), from the store's manifest.
void SetNonBlockBytes(MemoryModelInputs* in);

// The number of LoRA parameters (A and B of every targeted projection of every block).
int64_t LoraParameterCount(const ModelConfig& config, int64_t rank,
                           const std::vector<std::string>& targets);
// Their device bytes with their training state (AdapterStateBytes of each A and B).
uint64_t LoraStateBytes(const ModelConfig& config, int64_t rank,
                        const std::vector<std::string>& targets, bool eight_bit);

MemoryEstimate EstimateMemory(const MemoryModelInputs& inputs, const ResidencyPlan& plan);

// "" when a group's jobs (`inputs` with its group) fit `budget_bytes` under the smallest plan
// (every block streamed through a ring of one, the LM head streamed), else which job does not
// fit and by how much: the first, in the group's order (`first_name` is inputs' own job), whose
// share takes that plan's estimate beyond the budget.
std::string GroupBudgetRefusal(const MemoryModelInputs& inputs, uint64_t budget_bytes,
                               const std::string& first_name);

// The plan with the most resident blocks whose estimate fits `budget_bytes` (resident blocks
// spread as PlanFromSwapCount spreads them), its phases then filled with slots up to the
// budget (FillPhaseSlots). The LM head stays resident when some plan fits with it resident;
// only otherwise is it streamed. Refuses (kRefused) a budget below the minimum (every block
// and the LM head streamed), saying how many bytes that minimum is. Logs the plan and
// estimate.
ResidencyPlan PlanFromBudget(const MemoryModelInputs& inputs, uint64_t budget_bytes, int ring_size);

// `plan` with as many of its last blocks taped (ResidencyPlan::taped_blocks) as fit within
// `peak_bytes`, never fewer than it has.
ResidencyPlan FillTapedBlocks(const MemoryModelInputs& inputs, ResidencyPlan plan,
                              uint64_t peak_bytes);

// `plan` with as many slots in the forward and in the backward as fit within `peak_bytes`
// (at least ring_size, at most the streamed blocks), then as many of the backward's slots
// across the LM head as fit there: the memory timeline's headroom used as extra slots.
ResidencyPlan FillPhaseSlots(const MemoryModelInputs& inputs, ResidencyPlan plan,
                             uint64_t peak_bytes);
// Only the last step of that: as many of the backward's slots across the LM head as fit;
// and for a streamed head, head_prefetch_slots when the forward's slots beyond those it
// carries across the head can hold the head's copy.
ResidencyPlan FillHeadSlots(const MemoryModelInputs& inputs, ResidencyPlan plan,
                            uint64_t peak_bytes);

}  // namespace lorastream::worker
