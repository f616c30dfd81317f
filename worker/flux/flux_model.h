// FLUX.1's transformer (black-forest-labs/flux src/flux/model.py and modules/layers.py; the
// same arithmetic as diffusers' FluxTransformer2DModel) with LoRA on the blocks' linear layers,
// computed in the compute dtype (f32 for tests and parity, bf16 for training on a GPU):
//
//   vec = time_in(emb(t)) [+ guidance_in(emb(g))] + vector_in(pooled)     conditioning [B, H]
//   img = img_in(packed latents), txt = txt_in(t5_out), pe = RoPE over [txt_ids; img_ids]
//   double-stream blocks: per stream AdaLN (shift, scale, gate) x 2 from lin(silu(vec)),
//     fused qkv, per-head RMSNorm on q and k, one attention over [txt; img], proj, gated
//     GELU-tanh MLP
//   single-stream blocks over x = [txt; img]: linear1 -> (qkv, mlp in), attention,
//     linear2([attn; gelu(mlp)]), gated
//   final layer on the image tokens: AdaLN (shift, scale) then a linear to 64 channels.
//
// The blocks come from a BlockProvider in units (common/formats/flux_config.h: one double block, or
// `singles_per_unit` single blocks), so that the streaming engine serves them as it serves an
// LLM's blocks. Training checkpoints each unit: its forward keeps only its input streams, its
// backward re-acquires the unit, recomputes it with autograd on and takes the gradients of the
// streams and of the unit's LoRA weights (the base weights are frozen and never get one). A
// job group's forward (ForwardGroup) makes one such node per unit for all of its jobs: the
// unit is acquired once per pass, and each job's streams go through it in turn.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/flux_config.h"
#include "common/formats/manifest.h"
#include "worker/model/block_provider.h"
#include "worker/model/dit_ops.h"

namespace lorastream::worker::flux {

// Tensors by name: a unit's base weights as the provider serves them (BlockWeights::named,
// full BFL names) and the tensors outside the blocks.
using NamedTensors = dit::NamedTensors;

// The adapter: per adapted module (full BFL name, "double_blocks.0.img_attn.qkv") A [r, in]
// and B [out, r], f32 master weights that require grad; y = base(x) + B(A x) * alpha / r.
// A starts as peft and sd-scripts start it (kaiming-uniform, bound 1/sqrt(in)), B at zero.
class FluxAdapter : public dit::LoraAdapter {
 public:
  using Module = dit::LoraModule;
  // targets: block-relative names (FluxTargets); init from `seed` on the CPU, then to `device`;
  // a rank below 1 refused naming `rank_key` (the job's key, FluxKeyName).
  FluxAdapter(const FluxConfig& config, const std::vector<std::string>& targets, int64_t rank,
              double alpha, uint64_t seed, c10::Device device,
              const std::string& rank_key = "flux.rank");

  // The modules of a unit (full names), in name order.
  std::vector<std::string> UnitModules(const FluxUnit& unit) const;
};

// The LoRA weights a unit's forward reads, by module name (the adapter's own, or the
// detached leaves the checkpointed backward recomputes with).
using LoraMap = dit::LoraMap;

// What every block of a step reads besides its streams: the conditioning vector [B, H] and
// the rotary table pe [B, 1, L, head_dim / 2, 2, 2] (f32), both without grad.
struct FluxCompute {
  const FluxConfig* config = nullptr;
  at::Tensor vec, pe;
  double lora_scale = 1.0;
};

// One unit on its streams: a double block maps {img, txt} to {img, txt}, a unit of single
// blocks maps {x} to {x} (x = [txt; img]). `w` holds the unit's tensors by full name.
std::vector<at::Tensor> UnitForward(const FluxUnit& unit, const std::vector<at::Tensor>& streams,
                                    const NamedTensors& w, const LoraMap& lora,
                                    const FluxCompute& c);

// The model's inputs for a batch, on the device in the compute dtype (ids in f32).
struct FluxBatch {
  at::Tensor img;        // packed latents [B, N, in_channels]
  at::Tensor img_ids;    // [B, N, 3]
  at::Tensor txt;        // t5_out [B, L, context_in_dim]
  at::Tensor txt_ids;    // [B, L, 3]
  at::Tensor y;          // pooled [B, vec_in_dim]
  at::Tensor timesteps;  // [B] in [0, 1] (the model scales by 1000)
  at::Tensor guidance;   // [B]; ignored by a model without guidance_in
};

class FluxModel {
 public:
  // rest: the non-block tensors on `device` in `dtype`; the provider serves FluxUnits(config,
  // singles_per_unit) in order, each unit's tensors by full name in BlockWeights::named
  // (FluxBase's engine over its engine_manifest()).
  FluxModel(const FluxConfig& config, NamedTensors rest, BlockProvider* provider,
            int64_t singles_per_unit, c10::Device device, c10::ScalarType dtype);

  const FluxConfig& config() const { return config_; }
  const std::vector<FluxUnit>& units() const { return units_; }
  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  BlockProvider& provider() { return *provider_; }

  // The prediction [B, N, in_channels]. checkpointed: units run as checkpointed autograd
  // functions (training; any provider); otherwise plain autograd keeps every activation
  // (references, tests; the provider's blocks must stay valid until the backward: resident).
  at::Tensor Forward(const FluxBatch& batch, const FluxAdapter& adapter, bool checkpointed);
  // A job group's forward (worker/flux/flux_group.h): job j's batches[j] with adapters[j],
  // its prediction out[j]. Each unit is acquired once per pass for every job: the forward
  // runs it on each job's streams in turn, and a checkpointed unit's backward recomputes and
  // differentiates each job in turn. Each job's arithmetic is what Forward computes for it
  // alone (one backward over the jobs' summed losses gives each adapter its own gradients).
  std::vector<at::Tensor> ForwardGroup(const std::vector<const FluxBatch*>& batches,
                                       const std::vector<const FluxAdapter*>& adapters,
                                       bool checkpointed);
  // Units that a checkpointed forward runs taped instead: under plain autograd, which keeps
  // their activations into their backward (no recompute there). taped[u] for unit u (the
  // plan's TapedBlocks, worker/stream/stream_plan.h); only resident units may be taped (a
  // streamed unit's slot is overwritten before its backward). Empty: none.
  void SetTapedUnits(std::vector<bool> taped);
  // Whether a group's jobs of the same shapes (latent, caption, batch) with stackable
  // adapters run stacked, one base GEMM over every job's rows (worker/model/dit_ops.h;
  // default: dit::StackJobsByDefault(device)).
  void SetStackJobs(bool stack) { stack_jobs_ = stack; }
  // Whether the last forward ran its jobs stacked.
  bool last_forward_stacked() const { return last_stacked_; }

 private:
  FluxConfig config_;
  NamedTensors rest_;
  BlockProvider* provider_;
  std::vector<bool> taped_;
  bool stack_jobs_;
  bool last_stacked_ = false;
  std::vector<FluxUnit> units_;
  c10::Device device_;
  c10::ScalarType dtype_;
};

using dit::AvoidCudnnAttention;

// BFL's timestep_embedding(t, 256) with time_factor 1000: [cos | sin] of 1000 t * freqs, f32.
at::Tensor TimestepEmbedding(const at::Tensor& t, int64_t dim);
// BFL's EmbedND: ids [B, L, 3] -> pe [B, 1, L, head_dim / 2, 2, 2] (f32).
at::Tensor RopeTable(const at::Tensor& ids, const FluxConfig& config);

using dit::PackLatents;
using dit::UnpackLatents;
// img_ids [B, (H/2)(W/2), 3] of a latent of H x W: (0, row, column), f32.
at::Tensor ImageIds(int64_t batch, int64_t height, int64_t width, c10::Device device);

}  // namespace lorastream::worker::flux
