// What the diffusion families' transformers (FLUX.1, Qwen-Image) compute alike: LoRA linears
// over weights served by name, the per-head RMSNorm and the paired rotary embedding (fused
// kernels on CUDA), the plain LayerNorm, full attention over [text; image] (with a key mask
// when captions are padded), 2x2 latent packing, and a streaming unit run for a group of
// jobs either with plain autograd or as one checkpointed autograd node per pass (its forward
// keeps only the unit's input streams; its backward re-acquires the unit from the provider,
// recomputes each job in turn with autograd on and takes the gradients of the streams and of
// the job's LoRA weights), or a group's jobs of one shape stacked into one batch (below). A
// family supplies the unit's forward.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "worker/model/block_provider.h"

namespace lorastream::worker::dit {

// Tensors by name: a unit's base weights as the provider serves them (BlockWeights::named)
// and the tensors outside the units.
using NamedTensors = std::map<std::string, at::Tensor>;

// One adapted module's LoRA: A [r, in], B [out, r]; y = base(x) + B(A x) * scale. Jobs
// stacked into one batch (StackLoras) carry every job's: A [K, r, in], B [K, out, r].
struct LoraModule {
  at::Tensor a, b;
};
// By full module name: a job's modules of a unit (its own tensors, or the detached leaves
// the checkpointed backward recomputes with).
using LoraMap = std::map<std::string, LoraModule>;

// An adapter: per adapted module (full name) A [r, in] and B [out, r], f32 master weights
// that require grad; y = base(x) + B(A x) * alpha / r. A starts as peft and sd-scripts start
// it (kaiming-uniform, bound 1/sqrt(in)), B at zero, the modules drawn in the order given (so
// that the initial values depend on the seed and the module only).
class LoraAdapter {
 public:
  struct Shape {
    std::string name;
    int64_t out = 0, in = 0;
  };
  // `rank_key` names the job's key in the refusal of a rank below 1.
  LoraAdapter(const std::vector<Shape>& modules, int64_t rank, double alpha, uint64_t seed,
              c10::Device device, const std::string& rank_key);

  const LoraMap& modules() const { return modules_; }
  LoraMap& modules() { return modules_; }
  int64_t rank() const { return rank_; }
  double alpha() const { return alpha_; }
  double scale() const { return alpha_ / static_cast<double>(rank_); }
  // Every A and B, in module-name order.
  std::vector<at::Tensor> Params() const;
  // The modules whose names start with `prefix` ("transformer_blocks.3."), in name order.
  std::vector<std::string> ModulesUnder(const std::string& prefix) const;
  // Those modules with their tensors (a unit's LoraMap).
  LoraMap MapUnder(const std::string& prefix) const;

 private:
  LoraMap modules_;
  int64_t rank_;
  double alpha_;
};

// w[name], refused (kInternal) when absent.
const at::Tensor& Weight(const NamedTensors& w, const std::string& name);
// base(x) + B(A x) * scale with `module`.weight/.bias of `w`, the adapter cast to x's dtype
// as under autocast; the base alone when `lora` has no such module. A stacked module's A
// [K, r, in] and B [K, out, r] apply to x's K equal parts along its first dimension (job k's
// samples), each in the GEMM's epilogue; the base GEMM runs once over every job's rows.
at::Tensor LoraLinear(const at::Tensor& x, const NamedTensors& w, const std::string& module,
                      const LoraMap& lora, double scale);
// f32 (f64 for an f64 model: the tests' finite differences).
at::ScalarType AtLeastFloat(const at::Tensor& x);
// RMSNorm over the last dim, eps 1e-6: in f32, then (x * rrms).to(dtype) * scale (BFL's and
// diffusers' RMSNorm alike); fused on CUDA.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& scale);
// LayerNorm over the last dim without affine, eps 1e-6.
at::Tensor LayerNorm(const at::Tensor& x);
// Adaptive LayerNorm's modulation, LayerNorm(x) * (1 + scale) + shift, x [B, L, H] with
// shift and scale [B, 1, H]; and a gated residual, x + gate * y. On CUDA with one sample
// (B = 1) the modulation is one LayerNorm with (1 + scale, shift) as its affine weights (one
// kernel forward, one backward, rounded once), the gated residual one addcmul; elsewhere (the
// CPU, stacked jobs) the ATen ops as diffusers writes them.
at::Tensor Modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale);
at::Tensor GatedAdd(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y);
// Pairs (x0, x1) of the last dim rotated by pe [.., D/2, 2, 2]: pe[..., 0] x0 + pe[..., 1] x1
// (in f32).
at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& pe);
// One stream's part of joint attention: its q, k and v, each the H heads of D at a column of
// a projection's output [B, L, W] (one tensor may hold all three: FLUX.1's fused qkv), and
// the per-head RMSNorm scales of q and k [D].
struct AttentionStream {
  at::Tensor q, k, v;
  int64_t q_col = 0, k_col = 0, v_col = 0;
  at::Tensor q_scale, k_scale;
};
// Full attention over the streams' tokens joined in stream order ([text; image]): each
// stream's q and k RMS-normed per head with its scales (RmsNorm), the joint q and k rotated by
// pe [B or 1, 1, L, D / 2, 2, 2] (ApplyRope); `key_mask` [B, L] bool (true: attend) or
// undefined (every key). Returns [B, L, H D]. On CUDA the norms, the rotations and the joint
// layout are one kernel per part and one autograd node (FusedHeadsForward), the attention
// reading q, k and v where that kernel wrote them.
at::Tensor JointAttention(const std::vector<AttentionStream>& streams, int64_t heads,
                          int64_t head_dim, const at::Tensor& pe, const at::Tensor& key_mask = {});
// Whether JointAttention runs its fused kernel on `device` for a model of `dtype` and heads
// of head_dim (what the memory estimate counts on: no f32 copies of q and k).
bool JointHeadsFused(c10::Device device, c10::ScalarType dtype, int64_t head_dim);
// Keeps LibTorch's scaled_dot_product_attention off cuDNN's kernels on a GPU (their backward
// failed at FLUX.1's lengths in LibTorch 2.11); a no-op elsewhere. Process-wide.
void AvoidCudnnAttention(c10::Device device);

// A group's jobs as one batch: where every job's unit inputs have the same shapes and its
// adapter the same modules, ranks and scale (StackableAdapters), the family stacks the jobs'
// samples along the batch (each stream and per-sample tensor concatenated along dim 0, job
// after job) and runs each unit once for all of them: one base GEMM over every job's rows,
// each job's LoRA on its own samples (LoraLinear of StackLoras' modules). Its autograd
// reaches each job's own A and B through the stack. On CUDA by default; on the CPU each job
// runs alone (a GEMM's sums may depend on its row count there, and a job in a group computes
// bit for bit what it computes alone), unless a test asks (the families' SetStackJobs).
// LORASTREAM_STACK_JOBS=0 in the environment turns it off on CUDA too (A/B timing, bisecting).
bool StackJobsByDefault(c10::Device device);
// Whether the adapters stack: two or more, the same module names with the same A and B shapes,
// and the same scale.
bool StackableAdapters(const std::vector<const LoraAdapter*>& adapters);
// Per module, every job's A and B stacked (each map with the same modules).
LoraMap StackLoras(const std::vector<LoraMap>& maps);
// Whether every job's streams have the same count and shapes (the batch included).
bool SameStreamShapes(const std::vector<std::vector<at::Tensor>>& streams);
// The jobs' streams as one set (each concatenated along dim 0), and back: job j's part of
// each stacked stream (`jobs` equal parts along dim 0).
std::vector<at::Tensor> StackStreams(const std::vector<std::vector<at::Tensor>>& streams);
std::vector<std::vector<at::Tensor>> UnstackStreams(const std::vector<at::Tensor>& stacked,
                                                    size_t jobs);

// Latents [B, C, H, W] -> [B, (H/2)(W/2), 4C] ("b c (h 2) (w 2) -> b (h w) (c 2 2)") and back.
at::Tensor PackLatents(const at::Tensor& latents);
at::Tensor UnpackLatents(const at::Tensor& packed, int64_t height, int64_t width);

// One job's forward of a unit: streams -> streams over the unit's weights `w`, with its LoRA
// `lora`.
using UnitJobForward = std::function<std::vector<at::Tensor>(
    const std::vector<at::Tensor>& streams, const NamedTensors& w, const LoraMap& lora)>;
// One job's part of a unit: its forward and its LoRA modules of the unit.
struct UnitJob {
  UnitJobForward forward;
  LoraMap lora;
};
// Unit `index` of `provider` over every job's streams (*streams)[j], replaced by its outputs.
// checkpointed: one autograd node for all the jobs (the unit acquired once for their forward
// and once for their recomputes); else plain autograd (the provider's weights must stay
// valid until the backward: resident units).
void ForwardUnit(BlockProvider& provider, int index, const std::vector<UnitJob>& jobs,
                 std::vector<std::vector<at::Tensor>>* streams, bool checkpointed);
// A taped unit in training: its forward under plain autograd, which keeps every job's
// activations (and the weights they read) into the unit's backward, so nothing is recomputed
// there; the same arithmetic as the checkpointed unit's forward and recompute. Its outputs
// pass through one autograd node whose backward acquires and releases the unit, as a
// checkpointed unit's backward does, so the provider sees the step's order of uses. Only for a
// resident, uncompressed unit: its weights must stay as they are until the backward (the plan
// tapes nothing else, ResidencyPlan::tape_resident_only).
void ForwardUnitTaped(BlockProvider& provider, int index, const std::vector<UnitJob>& jobs,
                      std::vector<std::vector<at::Tensor>>* streams);

// How a model's group forward runs its units: checkpointed (training) or with plain autograd,
// the jobs stacked into one batch (StackJobsByDefault) or each on its own, and the model's
// flags of taped units (taped_units[u]: unit u keeps its activations into its backward when
// checkpointed; none past the end, none when null).
struct UnitRun {
  bool checkpointed = false;
  bool stacked = false;
  const std::vector<bool>* taped_units = nullptr;
};
// Unit `index` of a model's forward over every job's streams (one set for stacked jobs): job
// j runs forwards[j] with its LoRA loras[j] (stacked into one by StackLoras for stacked jobs,
// which have one forward); taped (ForwardUnitTaped) when `run` says so, else ForwardUnit.
void ForwardModelUnit(BlockProvider& provider, int index, std::vector<UnitJobForward> forwards,
                      std::vector<LoraMap> loras, const UnitRun& run,
                      std::vector<std::vector<at::Tensor>>* streams);
// The same with forwards[j] = forward(streams, w, lora, computes[j]): a family's unit forward
// over what each job (or the stacked jobs) computes with, `computes` (FluxCompute, ...).
template <class Compute, class Forward>
void ForwardModelUnit(BlockProvider& provider, int index, const std::vector<Compute>& computes,
                      const Forward& forward, std::vector<LoraMap> loras, const UnitRun& run,
                      std::vector<std::vector<at::Tensor>>* streams) {
  std::vector<UnitJobForward> forwards;
  for (const Compute& c : computes)
    forwards.push_back([forward, c](const std::vector<at::Tensor>& in, const NamedTensors& w,
                                    const LoraMap& lora) { return forward(in, w, lora, c); });
  ForwardModelUnit(provider, index, std::move(forwards), std::move(loras), run, streams);
}

}  // namespace lorastream::worker::dit
