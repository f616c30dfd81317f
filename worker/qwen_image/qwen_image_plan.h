// Planning a Qwen-Image job's streaming from a GPU memory budget (torch-free): its 60 blocks
// are all alike (one dual-stream block per unit, Qwen-Image in bf16: 648 MiB each), so the
// planner chooses how many stream and the ring's size, from the blocks' byte sizes, an
// estimate of the activations at the job's largest bucket and longest caption, and a cost
// model measured on the device (worker/qwen_image/qwen_image_calibrate.h). The estimate, the
// choice and a group's admission are the DiT planner's (worker/stream/dit_plan.h), with one
// kind of unit; this file gives it Qwen-Image's figures.
//
// The estimate per step (B latents of N image tokens, L text tokens, T = N + L, D hidden
// (heads x head_dim), M = 4D the MLP width, b bytes per compute element, P LoRA parameters):
//   weights      rest (img_in, txt_norm, txt_in, the timestep embedder, norm_out, proj_out)
//                + resident blocks + R x block
//   adapter      P x 16 (f32 master weights, gradients and AdamW's two moments)
//   checkpoints  blocks x B T D b: each block's input streams (image and text), kept by the
//                checkpointed blocks; plus the rotary table, one for the batch:
//                T x head_dim x 8 (f32 [T, head_dim / 2, 2, 2])
//   forward      one block's forward without grad: B T (b (6D + 2M) + 32D)
//   backward     one block recomputed with grad and its backward, what QwenImageBlockForward
//                keeps per token (b each, either stream's tokens):
//                  the LayerNorm's output (the modulation's product keeps it)          D
//                  the modulated input (the q/k/v projections and their LoRA keep it)  D
//                  q and k projected (their RMSNorm's inputs)                          2D
//                  q and k normalised, and v, concatenated over [txt; img]             3D
//                  q and k after the rotary step (attention's inputs)                  2D
//                  attention's output and its per-stream slices (to_out's inputs)      2D
//                  to_out / to_add_out's outputs (the gate's product keeps them)       D
//                  the residual (the second LayerNorm's input), its output, the
//                  modulated MLP input                                                 3D
//                  net.0.proj's output (GELU's input) and GELU's (net.2's input)       2M
//                  net.2's output (the gate's product keeps it)                        D
//                = 16D + 2M kept, and the backward's gradients through them at their
//                widest (the MLP's two M-wide gradients, attention's dq, dk, dv, the
//                streams' D): 4D + 2M; so B T (b (20D + 4M) + 32D), the 32D the f32 copies
//                of q and k the RMSNorm and rotary steps make: a dual-stream block's figures
//                (DualStreamBackwardPerToken, which FLUX.1's double blocks use too); plus
//                the streams' gradients 2 B T D b
//   attention    fused kernels: B heads T x 8 (log-sum-exp); where attention materialises
//                its scores (LibTorch 1.13, the CPU): B heads T^2 x 3b (the scaled scores,
//                the masked scores (padded captions) or their gradient, the probabilities)
//   tapes        per taped block (the last resident blocks, run under plain autograd: no
//                recompute), the kept list above, what autograd holds from the block's forward
//                to its backward: B T (b (16D + 2M) + 32D + 4 heads + 16 + 6 rank b)
//                (DualStreamTapePerToken; the LayerNorms' f32 mean and rstd; the A x of to_q,
//                to_k, to_v, to_out.0 and the MLP's two linears' LoRAs); where attention
//                materialises its scores, B heads T^2 x 3b more
//   reserve      allocator slack (0 on the CPU)
// peak = max(forward phase, backward phase), each fixed + ring + its working set + attention.
// It is an estimate: lorastream-worker plan prints it, and the GPU check compares it with the
// measured peak.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/qwen_image_config.h"
#include "common/job/job_spec.h"
#include "worker/stream/dit_plan.h"
#include "worker/stream/stream_cost.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker::qwen_image {

struct QwenImageMemoryInputs {
  QwenImageConfig config;
  std::vector<uint64_t> block_bytes;  // each block's bytes as copied
  // Of a compressed store: each block's linears expanded, in bytes of the compute dtype (one
  // expansion scratch of the largest); empty: the blocks are plain.
  std::vector<uint64_t> expanded_bytes;
  uint64_t rest_bytes = 0;  // the tensors outside the blocks, on the device
  DitJob job;               // P, B, N (largest bucket), L (longest caption)
  int compute_bytes = 2;    // 2: bf16; 4: f32
  bool attention_materialized = false;
  // Joint attention's q, k and v from the fused kernel (dit::JointHeadsFused): no f32
  // copies of q and k in the working sets and tapes.
  bool fused_heads = false;
  bool group_stacked = false;  // a group's jobs run as one batch (dit::StackJobsByDefault)
  uint64_t reserve_bytes = uint64_t{512} << 20;
  std::vector<DitJob> group;  // a group's other jobs
};

// Qwen-Image's blocks and per-token figures for the DiT planner (one kind: "blocks"); its
// refusals name stream.gpu_memory_budget and train.batch_size.
DitMemoryModel QwenImageMemoryModel(const QwenImageMemoryInputs& in);

DitMemoryEstimate EstimateQwenImageMemory(const QwenImageMemoryInputs& in,
                                          const ResidencyPlan& plan);

// A and B of every adapted linear of every block: blocks x rank x (in + out) per target
// (targets block-relative, as QwenImageTargets returns them).
int64_t QwenImageLoraParams(const QwenImageConfig& config, const std::vector<std::string>& targets,
                            int64_t rank);

// The most tokens a step of cache folder `dir` has, from its files' headers: the largest
// bucket's image tokens ((h / 2) (w / 2) of its latent; with `edit`, its control latents'
// added: the image stream's length) and the longest caption's text tokens. A file
// ScanQwenImageCache or CheckQwenImageCache refuses is refused naming it.
std::pair<int64_t, int64_t> QwenImageCacheTokens(const std::string& dir,
                                                 const QwenImageConfig& config, bool edit = false);

// A job's shape for the estimate: its adapter (lora.rank and lora.targets as the job file
// gives them), train.batch_size latents of its cache's most tokens (an edit job's control
// tokens counted with its image's).
DitJob QwenImageDitJob(const JobSpec& spec, const QwenImageConfig& config);

// The least streaming that fits `budget_bytes` as the cost model predicts it (ChooseDitPlan).
PlanChoice ChooseQwenImagePlan(const QwenImageMemoryInputs& in, const StepCosts& costs,
                               uint64_t budget_bytes, int max_ring = 3);

// "" when in.job with in.group fits `budget_bytes` with every block streamed through one slot;
// else which job does not, and by how much.
std::string QwenImageGroupBudgetRefusal(const QwenImageMemoryInputs& in, uint64_t budget_bytes);

}  // namespace lorastream::worker::qwen_image
