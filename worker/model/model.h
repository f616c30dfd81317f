// The Llama-family causal LM (llama, mistral, qwen2, qwen3) as transformers computes it:
// embeddings, per block RMSNorm -> attention (GQA, rotary, qwen2 q/k/v bias, qwen3 q/k norm)
// -> residual -> RMSNorm -> SwiGLU MLP -> residual, final RMSNorm, LM head (tied or not).
// LoRA is applied inside the projections as peft does: y = base(x) + B(A(dropout(x))) * scale,
// in the compute dtype as under torch.autocast (the f32 master weights cast to it); an f32
// model computes everything in f32. The block's arithmetic is in worker/model/block.h.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/formats/model_config.h"
#include "worker/model/base_weights.h"
#include "worker/model/block_provider.h"
#include "worker/model/lm_head.h"
#include "worker/model/lora.h"

namespace lorastream::worker {

// cos and sin [S, head_dim] in the compute dtype (computed in f32 as transformers does).
struct RotaryTables {
  at::Tensor cos, sin;
};
RotaryTables BuildRotary(const ModelConfig& config, int64_t seq_len, c10::Device device,
                         c10::ScalarType dtype);
// inv_freq [head_dim / 2] in f32 on the CPU, with rope_scaling (llama3, linear) applied.
at::Tensor RotaryInvFreq(const ModelConfig& config);

// transformers' RMSNorm: in f32, weight * normed.to(input dtype).
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// What a block's forward needs besides its input, weights and adapter. Plain values and
// pointers to objects the caller keeps alive until the step's backward has finished.
struct BlockCompute {
  const ModelConfig* config = nullptr;
  const RotaryTables* rope = nullptr;
  double lora_scale = 1.0;
  double dropout = 0.0;
  bool training = false;
  uint64_t dropout_seed = 0;  // per block and micro-batch: the recompute draws the same masks
};

// One transformer block on x [B, S, hidden]. When dropout is active the device's default
// generator is re-seeded with `c.dropout_seed` first, so that a recompute reproduces the masks.
at::Tensor BlockForward(const at::Tensor& x, const BlockWeights& w, const LoraBlock& lora,
                        const BlockCompute& c);

// The same block as a checkpointed autograd function (worker/model/checkpointed_block.cc): its
// forward runs without grad and keeps only x; its backward re-acquires the block from
// `provider`, recomputes it onto a tape and runs the hand-written BlockBackward
// (worker/model/block.h): the gradients of x and of the adapter, one autograd node per block.
// keep_tape: the forward fills the tape and the node keeps it, so that the backward runs
// without the recompute (the same tensors: bit for bit the same gradients).
at::Tensor CheckpointedBlockForward(const at::Tensor& x, int block, const LoraAdapter& adapter,
                                    BlockProvider& provider, const BlockCompute& c,
                                    bool keep_tape = false);

// One job's part of a checkpointed group block: its input [B, S, H], adapter and compute
// settings (the caller keeps the adapter and the rotary tables alive until the backward).
struct GroupBlockInput {
  at::Tensor x;
  const LoraAdapter* adapter = nullptr;
  BlockCompute compute;
};

// CheckpointedBlockForward for a group of jobs: one autograd node, the block acquired once
// per pass (forward, and recompute with backward) for every job, its base GEMMs over every
// job's rows on CUDA, per job on the CPU (worker/model/block.h: GroupBlockForwardTaped). Returns
// each job's output. A group of one is CheckpointedBlockForward.
std::vector<at::Tensor> CheckpointedGroupBlockForward(const std::vector<GroupBlockInput>& inputs,
                                                      int block, BlockProvider& provider,
                                                      bool keep_tape = false);

// One job's part of a group micro-batch (CausalLm::TrainGroupMicroBatch).
struct GroupMicroBatch {
  at::Tensor embeddings, targets, loss_divisor;
  const LoraAdapter* adapter = nullptr;
  uint64_t dropout_seed = 0;
};

class CausalLm {
 public:
  // The provider's blocks and rest.norm must be on `device` in `dtype` (the compute dtype).
  // rest.embed_tokens may stay in host RAM (any dtype): the batch's rows are gathered there
  // and only they are copied to the device (through pinned memory on CUDA); a compressed
  // rest.packed_embed's rows are expanded there. The LM head's weights come from `head` when
  // given (resident or streamed; the caller keeps it alive), else from rest.lm_head or a
  // compressed rest.packed_head (MakeResidentHead), kept on `device` in `dtype`.
  CausalLm(const ModelConfig& config, RestWeights rest, BlockProvider* provider, c10::Device device,
           c10::ScalarType dtype, HeadProvider* head = nullptr);

  const ModelConfig& config() const { return config_; }
  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  BlockProvider& provider() { return *provider_; }

  // Hidden states after the last block for ids [B, S] (int64 on the device). checkpointed:
  // blocks run through CheckpointedBlockForward (training always does); otherwise plain
  // autograd keeps every activation (tests and references). dropout_seed seeds each
  // block's masks (mixed with the block index).
  at::Tensor Hidden(const at::Tensor& ids, const LoraAdapter& adapter, bool training,
                    bool checkpointed, uint64_t dropout_seed);
  // Hidden from the batch's embeddings (Embed's): the blocks alone.
  at::Tensor HiddenFromEmbeddings(const at::Tensor& embeddings, const LoraAdapter& adapter,
                                  bool training, bool checkpointed, uint64_t dropout_seed);
  // The embeddings of ids [B, S] (int64, on the host when the table is) on the device,
  // gathered where the table is; on CUDA the copy is issued without waiting, so a trainer can
  // prepare its next batch while the device still runs the step before (worker/train/trainer.cc).
  at::Tensor Embed(const at::Tensor& ids);
  // Final norm and LM head: logits [B, S, vocab] in the compute dtype (the whole sequence's:
  // `lorastream-worker parity` writes them; training uses HeadLossSum).
  at::Tensor Logits(const at::Tensor& hidden);
  // Sum over positions of the cross-entropy of logits.float() against `targets` [B, S]
  // (already shifted: targets[s] = labels[s + 1]; -100 ignored), an f32 scalar.
  static at::Tensor LossSum(const at::Tensor& logits, const at::Tensor& targets);
  // LossSum(Logits(hidden), targets) without the whole sequence's logits: the chunked head
  // (worker/model/lm_head.h), in chunks of head_chunk_rows() rows; forward-only without grad.
  at::Tensor HeadLossSum(const at::Tensor& hidden, const at::Tensor& targets);
  // One micro-batch of a training step, as training runs it: the checkpointed forward of
  // every block, HeadLossSum divided by `loss_divisor` (the step's target count, an f32
  // scalar on the device: a CUDA graph of this reads it from there) and its backward (the
  // adapter's gradients accumulate), from the micro-batch's embeddings (Embed). Returns the
  // divided loss, a device scalar (reading it waits for the device).
  at::Tensor TrainMicroBatch(const at::Tensor& embeddings, const at::Tensor& targets,
                             const LoraAdapter& adapter, const at::Tensor& loss_divisor,
                             uint64_t dropout_seed);
  // TrainMicroBatch for a group of jobs: each block acquired once per pass for all of them,
  // its base GEMMs over every job's rows (per job on the CPU); each job's own head and loss (the
  // head acquired once for the group), divided by its own divisor; one backward through every job's
  // loss (the jobs share no parameter: each job's gradients are its own). Returns each job's
  // divided loss. A group of one is TrainMicroBatch.
  std::vector<at::Tensor> TrainGroupMicroBatch(const std::vector<GroupMicroBatch>& jobs);
  // TrainMicroBatch's loss_divisor for a step of `targets` target tokens (at least 1), on the
  // model's device; filled without waiting for it.
  at::Tensor LossDivisor(int64_t targets) const;
  // Rows per chunk of HeadLossSum for `tokens` positions: the one set, else as many as fit
  // kDefaultHeadChunkBytes (worker/model/head_rows.h), the bound the memory estimate assumes.
  int64_t head_chunk_rows(int64_t tokens) const;
  void set_head_chunk_rows(int64_t rows) { head_chunk_rows_ = rows; }

 private:
  const RotaryTables& Rotary(int64_t seq_len);
  // HiddenFromEmbeddings for a group: each block's pass runs once for every job.
  std::vector<at::Tensor> GroupHidden(const std::vector<at::Tensor>& embeddings,
                                      const std::vector<const LoraAdapter*>& adapters,
                                      bool training, bool checkpointed,
                                      const std::vector<uint64_t>& dropout_seeds);

  ModelConfig config_;
  RestWeights rest_;
  BlockProvider* provider_;
  std::unique_ptr<HeadProvider> own_head_;  // rest.lm_head when no head provider is given
  HeadProvider* head_;
  int64_t head_chunk_rows_ = 0;  // 0: from the default bound
  c10::Device device_;
  c10::ScalarType dtype_;
  std::map<int64_t, RotaryTables> rope_;
};

// The LM head's rows per chunk for `tokens` positions of `config` computed in `dtype` on a
// CUDA device or not (`cuda`): as many as kDefaultHeadChunkBytes holds, sized for the fused
// cross entropy where it runs. The model, its calibration and the memory estimate's inputs
// (MemoryModelInputs::fused_cross_entropy) agree through it.
int64_t DefaultHeadChunkRows(const ModelConfig& config, int64_t tokens, bool cuda,
                             c10::ScalarType dtype);

// Mixes a seed with up to three counters (splitmix64): independent streams per use.
uint64_t MixSeed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);

}  // namespace lorastream::worker
