// One transformer block with a hand-written backward for LoRA training.
//
// The checkpointed training step keeps only each block's input during the forward. In the
// backward it recomputes the block once, keeping on a BlockTape exactly what the backward
// reads, then runs BlockBackward: the input gradient and the adapter's A/B gradients, nothing
// else (the base weights are frozen, so no weight gradient is ever formed). No autograd graph
// is built inside a block except around the attention kernel, whose backward is the
// library's (flash attention on CUDA): one node, kept between the recompute and the backward.
//
// Arithmetic, as torch.autocast runs peft: the base and adapter matmuls in the compute dtype
// (the adapter's f32 master weights cast to it), RMSNorm in f32, the adapter's A and B
// gradients returned in f32. In an f32 model everything is f32 (the parity configuration).
// The projections reading one input share one GEMM for their A's (q/k/v, gate/up) and add the
// low-rank term into the base output in the GEMM's epilogue (addmm with beta 1).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/model/moe_mlp.h"

namespace lorastream::worker {

// The adapter gradients of one block (f32, undefined where the projection has no adapter),
// laid out as the adapter (LoraSlots enumerates both alike).
using LoraBlockGrads = LoraBlock;

// What one recompute of a block keeps for its backward, in the compute dtype: h1, the
// attention output (twice: the kernel's and o_proj's layout), out and h2 ([tokens, hidden]
// each), q, k, v, and gate, up and z ([tokens, intermediate] each); no f32 copies of
// activations, which the autograd graph of the f32 adapter path used to hold. For a group of
// jobs (BlockJob) the row-wise tensors hold every job's rows, concatenated in the group's
// order; attention and the adapters keep theirs per job.
struct BlockTape {
  struct Adapter {
    at::Tensor u;     // [N, r] = dropout(x) A^T, the B gradient's right factor
    at::Tensor xd;    // dropout(x) when dropout is active (else the group's input is used)
    at::Tensor mask;  // dropout's keep mask, when active
  };
  // One job's part: its shape, its attention and its adapters' factors.
  struct Job {
    int64_t batch = 0, seq = 0;
    at::Tensor q, k, v, attn;  // attention's inputs (leaves) and output [B, h, S, D]
    std::array<Adapter, kNumLoraTargets> lora;
  };
  at::Tensor x;               // block input rows [N, H]
  at::Tensor rstd_in, h1;     // input norm: 1/rms (f32 [N, 1]) and its output [N, H]
  at::Tensor q_pre, k_pre;    // qwen3: q, k before their per-head norm [N, h, D]
  at::Tensor rstd_q, rstd_k;  // qwen3: their 1/rms
  at::Tensor attn_flat;       // o_proj's input [N, heads * D]
  at::Tensor out;             // x + o_proj(attention) [N, H]
  at::Tensor rstd_post, h2;   // its norm: 1/rms and output [N, H]
  at::Tensor gate, up, z;     // MLP [N, I]; z = silu(gate) * up, down_proj's input
  MoeTape moe;                // a mixture of experts' MLP instead (worker/model/moe_mlp.h)
  std::vector<Job> jobs;
};

// One block's adapter in the compute dtype, cast once per step by the forward and kept for
// the recompute and the backward (three passes, one cast): A and B per target, and per
// projection group (q/k/v, o, gate/up, down) the A's of its adapted projections stacked
// [k * r, in] for their shared GEMM (undefined where the group has no adapter).
constexpr int kNumGroups = 4;
struct LoraBlockCast {
  LoraBlock lora;
  std::array<at::Tensor, kNumGroups> stacked;
  // A mixture of experts: every expert's A [E, r, in] and B [E, out, r] of gate, up and down
  // (undefined where not adapted), cast in one kernel each; lora.experts[e] holds views of
  // them. The grouped expert GEMMs read them whole.
  std::array<at::Tensor, 3> experts_a, experts_b;
};
LoraBlockCast CastLoraBlock(const LoraBlock& lora, c10::ScalarType dtype);

// One job's part of a grouped block pass: its adapter in the compute dtype and its compute
// settings (its rotary tables, LoRA scale, dropout and dropout seed). The jobs of a group
// share the block's weights, the model config and the compute dtype; their inputs may differ
// in batch and length.
struct BlockJob {
  const LoraBlockCast* lora = nullptr;
  const BlockCompute* compute = nullptr;
};

// The block's forward for a group of jobs, xs[j] [B_j, S_j, H] each, without grad mode,
// filling `tape` (when given; it must be empty) for GroupBlockBackward. Every base projection
// is one GEMM over the concatenation of every job's rows; each job's low-rank terms are added
// to its own rows, and attention runs per job. Row-wise steps (norms, SwiGLU, residuals) run
// over the concatenation. Each job's dropout masks are drawn from its own seed in the order a
// pass of the job alone draws them. A group of one is the job alone: nothing is concatenated.
std::vector<at::Tensor> GroupBlockForwardTaped(const std::vector<at::Tensor>& xs,
                                               const BlockWeights& w,
                                               const std::vector<BlockJob>& jobs, BlockTape* tape);

// The gradients of the group whose forward filled `tape`, for the output gradients dys[j]:
// fills grads[j] (f32) and returns each dL/dx_j (undefined when !need_dx). dY W is one GEMM
// over every job's rows. Consumes the tape.
std::vector<at::Tensor> GroupBlockBackward(BlockTape& tape, const BlockWeights& w,
                                           const std::vector<BlockJob>& jobs,
                                           const std::vector<at::Tensor>& dys, bool need_dx,
                                           std::vector<LoraBlockGrads>& grads);

// The same for one job (a group of one).
at::Tensor BlockForwardTaped(const at::Tensor& x, const BlockWeights& w, const LoraBlockCast& lora,
                             const BlockCompute& c, BlockTape* tape);
at::Tensor BlockBackward(BlockTape& tape, const BlockWeights& w, const LoraBlockCast& lora,
                         const BlockCompute& c, const at::Tensor& dy, bool need_dx,
                         LoraBlockGrads& grads);

}  // namespace lorastream::worker
