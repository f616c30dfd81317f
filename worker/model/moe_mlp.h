// The MLP of a mixture-of-experts block (qwen3_moe, mixtral) as transformers 5 computes it,
// with LoRA on every expert's gate, up and down projections: the seam of the LLM block
// (worker/model/block.cc) where a dense block runs its SwiGLU MLP.
//
// Router (frozen): logits = h R^T in the compute dtype, a softmax over all experts in f32,
// the top num_experts_per_tok probabilities (renormalised to sum 1 when norm_topk_prob, and
// always for mixtral), cast to the compute dtype. Each expert runs its gated MLP over the
// tokens routed to it (index_select; one GEMM per projection over those tokens of every job
// of a group, per job on the CPU so that a job computes bit for bit what it computes alone),
// each job's low-rank terms on its own tokens, and its outputs, times their routing weights,
// are summed into the tokens' rows (index_add), expert by expert in index order.
//
// The backward reads the tape of a forward (or of the checkpointed recompute, whose routing
// is the forward's bit for bit: the same inputs, the same arithmetic): the expert GEMMs by
// hand, and the routing weights' gradient through the softmax and renormalisation by
// autograd over a [tokens, experts] graph, the router's own weight never differentiated.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/formats/model_config.h"
#include "worker/model/block_weights.h"
#include "worker/model/lora.h"

namespace lorastream::worker {

// One job's part of a group's MoE pass: its rows [offset, offset + rows) of the group's
// concatenated tokens, its block adapter in the compute dtype (experts[e] sized when it
// targets the experts), its LoRA scale, and where the adapter has them, its experts' A and B
// of gate, up and down stacked ([E, r, in], [E, out, r]; lora->experts[e] are views of them).
struct MoeJob {
  int64_t offset = 0, rows = 0;
  const LoraBlock* lora = nullptr;
  double scale = 1.0;
  std::array<at::Tensor, 3> stacked_a, stacked_b;
};

// How the experts' GEMMs run. kPerExpert: one GEMM per expert and projection over its tokens
// (every LibTorch, every device and dtype; on the CPU a job computes bit for bit what it
// computes alone). kGrouped (CUDA, bf16, LibTorch >= 2.9): the routed tokens sorted by
// expert (and job), each projection one grouped GEMM over every expert (at::_grouped_mm), the
// jobs' low-rank terms likewise over (expert, job) groups, no host synchronisation; the
// experts' outputs summed per token in slot order. kAuto: kGrouped where it runs, else
// kPerExpert. The two agree to the rounding of the compute dtype (tests/gpu).
enum class MoeGemms { kAuto, kPerExpert, kGrouped };

// Whether kGrouped runs for x here (its device, its dtype, this LibTorch).
bool GroupedMoeAvailable(const at::Tensor& x);
// The same for a computation on `device` in `dtype`.
bool GroupedMoeAvailable(const c10::Device& device, c10::ScalarType dtype);
// And for a model of `config` (its widths multiples of 8). Where this holds, kAuto groups, and
// a mixture-of-experts pass never waits for the device: its steps may run as CUDA graphs.
bool GroupedMoeAvailable(const ModelConfig& config, const c10::Device& device,
                         c10::ScalarType dtype);

// What a taped MoE pass keeps for its backward.
struct MoeTape {
  // One expert's GEMMs over one run of tokens (every job's on CUDA, one job's on the CPU).
  struct Run {
    int64_t expert = 0;
    at::Tensor tokens, slots;  // int64 [n]: the rows routed to the expert and their top-k slot
    at::Tensor gate, up, z;    // [n, I]
    at::Tensor d;              // the expert's output before its routing weight [n, H]
    struct Part {              // a job's tokens of the run: [begin, begin + count)
      size_t job = 0;
      int64_t begin = 0, count = 0;
      std::array<at::Tensor, 3> u;  // x A^T per adapted projection (gate, up, down) [count, r]
    };
    std::vector<Part> parts;
  };
  // Of a grouped pass: the routed slots (token * k + slot) sorted by (expert, job), their
  // tokens, the int32 end offsets of each expert's and each (expert, job)'s run of them, the
  // projections' outputs over the sorted slots and each adapted projection's x A^T [M, r].
  struct Grouped {
    at::Tensor order, tokens, expert_ends, group_ends;
    at::Tensor gate, up, z, d;
    std::array<at::Tensor, 3> u;
  };
  bool grouped = false;
  Grouped g;
  at::Tensor logits;   // the router's logits as an f32 leaf [N, E] (autograd)
  at::Tensor chosen;   // the routing weights in f32 [N, k], a function of `logits`
  at::Tensor weights;  // the same in the compute dtype (detached)
  std::vector<Run> runs;
};

// The MoE MLP of x [N, H] (the post-attention norm's output of every job's rows) for
// `jobs`; per_job_gemms: each job's tokens get their own GEMMs (the CPU in a group). With
// `tape` null and grad mode on, autograd differentiates everything (the reference path).
at::Tensor MoeForward(const at::Tensor& x, const BlockWeights& w, const ModelConfig& config,
                      const std::vector<MoeJob>& jobs, bool per_job_gemms, MoeTape* tape,
                      MoeGemms gemms = MoeGemms::kAuto);

// dL/dx for the output gradient dy [N, H], each job's expert LoRA gradients (f32, zeros for
// an expert no token of the job reached) into grads[j].experts, by the GEMMs the forward
// used. Consumes the tape.
at::Tensor MoeBackward(MoeTape& tape, const at::Tensor& x, const BlockWeights& w,
                       const std::vector<MoeJob>& jobs, bool per_job_gemms, const at::Tensor& dy,
                       std::vector<LoraBlock>& grads);

}  // namespace lorastream::worker
