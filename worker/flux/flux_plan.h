// Planning a FLUX job's streaming from a GPU memory budget (torch-free): its units are of two
// sizes (FLUX.1-dev in bf16: a double-stream block 648 MiB, a unit of two single-stream
// blocks 540 MiB), so the planner chooses how many of each kind stream, the ring's size
// (a slot holds the largest streamed unit: streaming single units only makes every slot
// smaller) and which units stay resident, from the units' real byte sizes, an estimate of the
// activations at the job's resolution and a cost model measured on the device
// (worker/flux/flux_calibrate.h). The estimate, the choice and a group's admission are the
// DiT planner's (worker/stream/dit_plan.h); this file gives it FLUX's units and figures.
//
// The estimate per step (B images of N image tokens and L text tokens, T = N + L, H hidden,
// M MLP width, b bytes per compute element, P LoRA parameters):
//   weights      rest (embedders, final layer) + resident units + R x (largest streamed unit);
//                a compressed store's units as stored (resident and in slots), every use
//                expanding its linears into one scratch of the largest unit's (compute dtype)
//   adapter      P x 16 (f32 master weights, gradients and AdamW's two moments; with 8-bit
//                moments AdapterStateBytes: about P x 10)
//   checkpoints  units x B T H b: each unit's input streams, kept by the checkpointed units,
//                plus the rotary table (B T head_dim x 8: f32 [.., 2, 2] pairs)
//   forward      one unit's forward without grad: B T (b (6H + 2M) + 32 H) per block
//                (a dual-stream block's, DualStreamForwardPerToken)
//   backward     one unit recomputed with grad and its backward, the largest of the units:
//                B T (b (20H + 4M) + 32H) per double block (DualStreamBackwardPerToken),
//                B T (b (15H + 5M) + 32H) per
//                single block (a unit of c single blocks: c of them, one graph), plus the
//                streams' gradients 2 B T H b; the 32H are the f32 copies of q and k that
//                the RMSNorm and rotary steps make
//   attention    fused kernels: B heads T x 8 (log-sum-exp); where attention materialises
//                its scores (LibTorch 1.13, the CPU): B heads T^2 x 2b
//   tapes        per taped unit (the last resident units, run under plain autograd: no
//                recompute), what autograd keeps from its forward to its backward: B T
//                (b (16H + 2M) + 32H + 4 heads + 16 + 4 rank b) per double block
//                (DualStreamTapePerToken and its qkv, proj and MLP LoRAs' A x), B T (b (13H +
//                3M) + 32H + 4 heads + 8 + 2 rank b) per single block (SingleStreamTapePerToken,
//                linear1's and linear2's A x); where attention materialises its scores, B heads
//                T^2 x 2b per block more
//   reserve      allocator slack
// peak = max(forward phase, backward phase), each fixed + ring + its working set + attention.
// It is an estimate: the benchmark prints the measured peak next to it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/flux_config.h"
#include "worker/stream/dit_plan.h"
#include "worker/stream/stream_cost.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker::flux {

// A job of a group besides the one a FluxMemoryInputs describes: its own adapter and batch.
using FluxGroupMember = DitJob;

struct FluxMemoryInputs {
  FluxConfig config;
  std::vector<FluxUnit> units;       // FluxUnits(config, singles_per_unit)
  std::vector<uint64_t> unit_bytes;  // each unit's bytes as copied (compute dtype, or compressed)
  // Of a compressed store: each unit's linears expanded, in bytes of the compute dtype
  // (worker/model/quant_expand.h); empty: the units are plain.
  std::vector<uint64_t> expanded_bytes;
  uint64_t rest_bytes = 0;           // the tensors outside the blocks, on the device
  int64_t lora_params = 0;           // A and B of every adapted module
  int64_t lora_rank = 0;             // their rank (a taped unit keeps each linear's A x)
  bool eight_bit_optimizer = false;  // 8-bit AdamW moments (flux.optimizer = "adamw8bit")
  int64_t batch = 1;
  int64_t image_tokens = 0;  // of the largest bucket: (H / 16) (W / 16)
  int64_t text_tokens = 0;   // T5 tokens per caption (512 for FLUX.1-dev)
  int compute_bytes = 2;     // 2: bf16; 4: f32
  bool attention_materialized = false;
  // Joint attention's q, k and v from the fused kernel (dit::JointHeadsFused): no f32
  // copies of q and k in the working sets and tapes.
  bool fused_heads = false;
  bool group_stacked = false;  // a group's jobs run as one batch (dit::StackJobsByDefault)
  uint64_t reserve_bytes = uint64_t{512} << 20;
  // A job group's other jobs (worker/flux/flux_group.h): the estimate adds their adapters,
  // checkpoints and streams' gradients; their working sets take turns with this job's, or add
  // up with it where the group runs stacked (group_stacked).
  std::vector<FluxGroupMember> group;
};

using FluxMemoryEstimate = DitMemoryEstimate;

// FLUX's units and per-token figures for the DiT planner (kinds: double, single), and the
// job `in` describes.
DitMemoryModel FluxMemoryModel(const FluxMemoryInputs& in);
DitJob FluxDitJob(const FluxMemoryInputs& in, const std::string& name = "");

// With in.group: the weights, ring and reserve once, each job's adapter, checkpoints and
// streams' gradients, and the largest job's working set and attention.
FluxMemoryEstimate EstimateFluxMemory(const FluxMemoryInputs& in, const ResidencyPlan& plan);

// "" when the group (in with in.group) fits `budget_bytes` under its smallest plan (every unit
// streamed through one slot); else which job does not fit beside the ones before it and by how
// much (first_name: in's own job).
std::string FluxGroupBudgetRefusal(const FluxMemoryInputs& in, uint64_t budget_bytes,
                                   const std::string& first_name);

// `doubles` of the double units and `singles` of the single units streamed (each kind's
// resident units spread over its depth, as PlanFromSwapCount spreads them), through a ring of
// min(ring, streamed) slots.
ResidencyPlan FluxResidency(const FluxMemoryInputs& in, int doubles, int singles, int ring);

// The `block_scale` of `costs` for these units: a double unit computes 1 (the block figures
// are a double block's), a unit of c single blocks c x single_to_double.
std::vector<double> FluxBlockScale(const FluxMemoryInputs& in, double single_to_double);

// ChooseDitPlan over FLUX's two kinds; its refusal names flux.gpu_memory_budget.
PlanChoice ChooseFluxPlan(const FluxMemoryInputs& in, const StepCosts& costs, uint64_t budget_bytes,
                          int max_ring = 3);

}  // namespace lorastream::worker::flux
