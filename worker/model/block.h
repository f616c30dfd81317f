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

#include <ATen/core/Tensor.h>

#include "worker/model/lora.h"
#include "worker/model/model.h"

namespace lorastream::worker {

// The adapter gradients of one block (f32, undefined where the projection has no adapter).
struct LoraBlockGrads {
  std::array<at::Tensor, kNumLoraTargets> a, b;
};

// What one recompute of a block keeps for its backward, in the compute dtype: h1, the
// attention output (twice: the kernel's and o_proj's layout), out and h2 ([tokens, hidden]
// each), q, k, v, and gate, up and z ([tokens, intermediate] each); no f32 copies of
// activations, which the autograd graph of the f32 adapter path used to hold.
struct BlockTape {
  struct Adapter {
    at::Tensor u;     // [N, r] = dropout(x) A^T, the B gradient's right factor
    at::Tensor xd;    // dropout(x) when dropout is active (else the group's input is used)
    at::Tensor mask;  // dropout's keep mask, when active
  };
  at::Tensor x;               // block input [B, S, H]
  at::Tensor rstd_in, h1;     // input norm: 1/rms (f32 [N, 1]) and its output [N, H]
  at::Tensor q_pre, k_pre;    // qwen3: q, k before their per-head norm [B, S, h, D]
  at::Tensor rstd_q, rstd_k;  // qwen3: their 1/rms
  at::Tensor q, k, v, attn;   // attention's inputs (leaves) and output [B, h, S, D]
  at::Tensor attn_flat;       // o_proj's input [N, heads * D]
  at::Tensor out;             // x + o_proj(attention) [N, H]
  at::Tensor rstd_post, h2;   // its norm: 1/rms and output [N, H]
  at::Tensor gate, up, z;     // MLP [N, I]; z = silu(gate) * up, down_proj's input
  std::array<Adapter, kNumLoraTargets> lora;
};

// One block's adapter in the compute dtype, cast once per step by the forward and kept for
// the recompute and the backward (three passes, one cast): A and B per target, and per
// projection group (q/k/v, o, gate/up, down) the A's of its adapted projections stacked
// [k * r, in] for their shared GEMM (undefined where the group has no adapter).
constexpr int kNumGroups = 4;
struct LoraBlockCast {
  LoraBlock lora;
  std::array<at::Tensor, kNumGroups> stacked;
};
LoraBlockCast CastLoraBlock(const LoraBlock& lora, c10::ScalarType dtype);

// The block's forward without grad mode, filling `tape` (when given; it must be empty) for
// BlockBackward. Only the attention builds its one autograd node.
at::Tensor BlockForwardTaped(const at::Tensor& x, const BlockWeights& w, const LoraBlockCast& lora,
                             const BlockCompute& c, BlockTape* tape);

// The gradients of the block whose forward filled `tape`, for the output gradient dy
// [B, S, H]: fills `grads` (f32) and returns dL/dx (undefined when !need_dx). Consumes the
// tape (its tensors are released as soon as they are read, lowering the backward's peak).
at::Tensor BlockBackward(BlockTape& tape, const BlockWeights& w, const LoraBlockCast& lora,
                         const BlockCompute& c, const at::Tensor& dy, bool need_dx,
                         LoraBlockGrads& grads);

}  // namespace lorastream::worker
