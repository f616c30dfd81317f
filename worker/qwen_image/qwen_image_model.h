// Qwen-Image's transformer (diffusers' QwenImageTransformer2DModel, v0.39) with LoRA on the
// blocks' linear layers, computed in the compute dtype (f32 for tests and parity, bf16 for
// training on a GPU):
//
//   temb = linear_2(silu(linear_1(sinusoid(1000 t))))                     [B, D]
//   img = img_in(packed latents [B, N, 64]); txt = txt_in(RMSNorm(hidden states [B, L, 3584]))
//   RoPE over [txt; img]: image token (row, col) at (0, row - ceil(H/2) .. , col - ceil(W/2)),
//     centred as diffusers' QwenEmbedRope(scale_rope) computes it; text token i at
//     max(H/2, W/2) + i on every axis
//   Qwen-Image-Edit: the control images' packed latents follow the image's tokens in the image
//     stream (the pipeline's cat([latents, image_latents], 1)), control k at frame k + 1, its
//     rows and columns centred on its own grid, the text after the largest max(H/2, W/2) of
//     every image (QwenEmbedRope over img_shapes [(1, H, W), (1, Hc, Wc), ...]); every block
//     runs on the longer stream unchanged; the prediction is the image's tokens alone
//   per block: per stream AdaLN (shift, scale, gate) x 2 from img_mod.1 / txt_mod.1 on
//     silu(temb); q, k, v of each stream (attn.to_* / attn.add_*_proj), per-head RMSNorm of q
//     and k, one attention over [txt; img] (padded caption tokens masked as keys), to_out.0 /
//     to_add_out, gated; then the GELU-tanh MLPs (net.0.proj, net.2), gated
//   norm_out (AdaLN: scale, shift) and proj_out on the image tokens.
//
// The blocks come from a BlockProvider, one block per unit, their tensors by full name; a
// checkpointed unit recomputes in its backward (worker/model/dit_ops.h), as FLUX's do.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/qwen_image_config.h"
#include "worker/model/block_provider.h"
#include "worker/model/dit_ops.h"

namespace lorastream::worker::qwen_image {

using dit::LoraMap;
using dit::NamedTensors;

// The adapter on the blocks' linears named by `targets` (block-relative: QwenImageTargets),
// full names "transformer_blocks.N.attn.to_q"; A drawn block by block from `seed`.
class QwenImageAdapter : public dit::LoraAdapter {
 public:
  QwenImageAdapter(const QwenImageConfig& config, const std::vector<std::string>& targets,
                   int64_t rank, double alpha, uint64_t seed, c10::Device device);
  // Block `index`'s modules with their tensors.
  LoraMap UnitLora(int64_t index) const;
};

// What every block of a step reads besides its streams.
struct QwenImageCompute {
  const QwenImageConfig* config = nullptr;
  at::Tensor temb;      // [B, D] in the compute dtype
  at::Tensor pe;        // [1, 1, L_txt + N, head_dim / 2, 2, 2] f32
  at::Tensor key_mask;  // [B, L_txt + N] bool, or undefined (no padded caption)
  double lora_scale = 1.0;
};

// Block `index` on {img, txt} -> {img, txt}; `w` holds its tensors by full name.
std::vector<at::Tensor> QwenImageBlockForward(int64_t index, const std::vector<at::Tensor>& streams,
                                              const NamedTensors& w, const LoraMap& lora,
                                              const QwenImageCompute& c);

// The model's inputs for a batch (every image of one latent size).
struct QwenImageBatch {
  at::Tensor img;                  // packed latents [B, N, in_channels], N = grid_h x grid_w
  at::Tensor txt;                  // Qwen2.5-VL hidden states [B, L, joint_attention_dim]
  at::Tensor txt_mask;             // [B, L] bool (true: a caption token), or undefined (all tokens)
  at::Tensor timesteps;            // [B] in [0, 1] (the model scales by 1000)
  int64_t grid_h = 0, grid_w = 0;  // latent height and width / 2
  // Qwen-Image-Edit: the control images' packed latents [B, Nc, in_channels], each image's
  // tokens after the previous one's, and their grids (Nc = the sum of their products);
  // undefined and empty for a text-to-image batch.
  at::Tensor control;
  std::vector<std::pair<int64_t, int64_t>> control_grids;
};

// diffusers' Timesteps(256, flip_sin_to_cos, shift 0, scale 1000): [cos | sin] of
// 1000 (t * freqs), f32.
at::Tensor QwenTimestepEmbedding(const at::Tensor& t, int64_t dim);
// The rotary table over [txt (txt_len tokens); images], `grids` each image's (grid_h, grid_w)
// (the target first, then an edit batch's controls; image k at frame k), as QwenEmbedRope
// computes its angles (f32): [1, 1, txt_len + N, head_dim / 2, 2, 2], N every image's tokens.
at::Tensor QwenRopeTable(const QwenImageConfig& config,
                         const std::vector<std::pair<int64_t, int64_t>>& grids, int64_t txt_len,
                         c10::Device device);

class QwenImageModel {
 public:
  // rest: the tensors outside the blocks on `device` in `dtype`; the provider serves the
  // blocks in order, each one's tensors by full name.
  QwenImageModel(const QwenImageConfig& config, NamedTensors rest, BlockProvider* provider,
                 c10::Device device, c10::ScalarType dtype);

  const QwenImageConfig& config() const { return config_; }
  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  BlockProvider& provider() { return *provider_; }

  // The prediction [B, N, out_dim]. checkpointed: each block one checkpointed autograd node
  // (training; any provider); otherwise plain autograd (resident blocks).
  at::Tensor Forward(const QwenImageBatch& batch, const QwenImageAdapter& adapter,
                     bool checkpointed);
  // A group's forward: each block acquired once per pass for every job; each job's
  // arithmetic is Forward's for it alone. Jobs of the same shapes (image and control grids,
  // caption length, batch) and stackable adapters run stacked where SetStackJobs allows
  // (worker/model/dit_ops.h StackJobsByDefault: one base GEMM over every job's rows).
  std::vector<at::Tensor> ForwardGroup(const std::vector<const QwenImageBatch*>& batches,
                                       const std::vector<const QwenImageAdapter*>& adapters,
                                       bool checkpointed);
  // Blocks that a checkpointed forward runs taped instead: under plain autograd, which keeps
  // their activations into their backward (no recompute there). taped[u] for block u (the
  // plan's TapedBlocks, worker/stream/stream_plan.h); only resident blocks may be taped (a
  // streamed block's slot is overwritten before its backward). Empty: none.
  void SetTapedUnits(std::vector<bool> taped);
  // Whether a group's jobs may run stacked (default: dit::StackJobsByDefault(device)).
  void SetStackJobs(bool stack) { stack_jobs_ = stack; }
  // Whether the last forward ran its jobs stacked.
  bool last_forward_stacked() const { return last_stacked_; }

 private:
  // QwenRopeTable of (grids, txt_len) on the device, made once per shape: no host
  // computation and copy (a wait for the device) at every step.
  const at::Tensor& RopeTableFor(const std::vector<std::pair<int64_t, int64_t>>& grids,
                                 int64_t txt_len);

  QwenImageConfig config_;
  NamedTensors rest_;
  BlockProvider* provider_;
  std::vector<bool> taped_;
  bool stack_jobs_;
  bool last_stacked_ = false;
  c10::Device device_;
  c10::ScalarType dtype_;
  std::map<std::vector<int64_t>, at::Tensor> rope_tables_;  // by (txt_len, grids)
};

}  // namespace lorastream::worker::qwen_image
