// Planning a diffusion transformer's streaming from a GPU memory budget (torch-free), for the
// families whose units are DiT blocks run once per step over image and text tokens (FLUX.1:
// worker/flux/flux_plan.h; Qwen-Image: worker/qwen_image/qwen_image_plan.h). A family says
// what its units weigh and what they keep per token (DitMemoryModel); the estimate, the
// choice of plan and a group's admission are this file's, the same for every such family.
//
// Units come in kinds (FLUX.1: double-stream blocks and units of single-stream blocks;
// Qwen-Image: one kind): a plan streams some units of each kind, spread over that kind's depth
// as PlanFromSwapCount spreads them, through a ring whose slot holds the largest streamed unit.
//
// The estimate per step for a job of B latents of N image tokens and L text tokens (T = N + L,
// P LoRA parameters), from the family's per-token figures (bytes per token of B T):
//   weights      rest + resident units + R x (largest streamed unit); a compressed store's
//                units as stored, every use expanding into one scratch of the largest
//                unit's expanded bytes
//   adapter      P x 16 (f32 master weights, gradients and AdamW's two moments; with 8-bit
//                moments AdapterStateBytes: about P x 10)
//   checkpoints  B T checkpoint_per_token + (B T or T) table_per_token (the rotary table:
//                per latent, or one for the batch)
//   forward      B T forward_per_token: one unit's forward without grad
//   backward     B T max over units of backward_per_token[u] (one unit recomputed with grad
//                and its backward) + B T stream_grads_per_token (the streams' gradients)
//   attention    fused kernels: B heads T x 8 (log-sum-exp); materialised scores (LibTorch
//                1.13, the CPU): B heads T^2 x score_bytes
//   tapes        per taped unit (ResidencyPlan::taped_blocks: the last resident units in
//                forward order, run under plain autograd instead of checkpointed, so their
//                activations live from their forward to their backward and their forward is
//                not recomputed): B T (tape_per_token[u] + rank x tape_lora[u]) (what
//                autograd saves for the unit's linears, norms, modulation, attention and MLP,
//                and the LoRA's A x of each token-wise linear), plus, where attention
//                materialises its scores, B heads T^2 x score_bytes per attention
//   reserve      allocator slack
// peak = max(forward phase, backward phase), each fixed + ring + its working set + attention;
// the forward phase holds every tape, the backward every tape but that of the unit whose
// backward comes first when it is taped (its tape is part of its working set).
// A group's other jobs add their adapters, checkpoints, streams' gradients and tapes; the
// weights, ring and reserve count once. Its working sets and attention: where the group's
// jobs run stacked (group_stacked: one batch through each unit, worker/model/dit_ops.h),
// every job's together; else the largest job's (a unit runs, and is recomputed with its
// backward, for one job after another).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "worker/stream/stream_cost.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker {

// A dual-stream (MMDiT) block's working sets per token (H hidden, M MLP width, b bytes per
// compute element): FLUX.1's double blocks and Qwen-Image's blocks (their derivation:
// worker/qwen_image/qwen_image_plan.h). Forward without grad: b (6H + 2M) + 32H; recomputed
// with grad and its backward: b (20H + 4M) + 32H (the 32H: the f32 copies of q and k that the
// RMSNorm and rotary steps make). Where joint attention's q, k and v come from the fused
// kernel (`fused`: CUDA, dit::JointAttention) there are no f32 copies: without the 32H.
inline uint64_t QkF32Copies(uint64_t h, bool fused) { return fused ? 0 : 32 * h; }
inline uint64_t DualStreamForwardPerToken(uint64_t h, uint64_t m, uint64_t b, bool fused) {
  return b * (6 * h + 2 * m) + QkF32Copies(h, fused);
}
inline uint64_t DualStreamBackwardPerToken(uint64_t h, uint64_t m, uint64_t b, bool fused) {
  return b * (20 * h + 4 * m) + QkF32Copies(h, fused);
}
// What a taped dual-stream block keeps per token (b bytes each unless said; `heads`
// attention heads), the list of its derivation (worker/qwen_image/qwen_image_plan.h) that
// the recompute holds: the LayerNorm's output H, the modulated input H, q and k projected 2H,
// q and k normalised and v 3H, q and k after the rotary step 2H, attention's output and its
// per-stream slices 2H, the projections' outputs H, the residual, its LayerNorm's output and
// the modulated MLP input 3H, the MLP's two M-wide activations 2M, its output H: b (16H + 2M);
// the f32 copies of q and k the RMSNorm and rotary steps make, 32H; attention's log-sum-exp,
// 4 heads; the two LayerNorms' mean and rstd (f32), 16. With the fused kernel: the
// LayerNorm's input H and the modulated input H, the projections' q, k and v 3H (the kernel's
// input), the kernel's q, k and v 3H (attention's), attention's output and its slices 2H, the
// projection's output H, the residual and the modulated MLP input 2H, 2M, the MLP's output H:
// b (14H + 2M), no f32 copies.
inline uint64_t DualStreamTapePerToken(uint64_t h, uint64_t m, uint64_t b, uint64_t heads,
                                       bool fused) {
  return b * ((fused ? 14 : 16) * h + 2 * m) + QkF32Copies(h, fused) + 4 * heads + 16;
}
// The same for FLUX.1's single-stream block: the LayerNorm's output H, the modulated input H
// (linear1's), linear1's output 3H + M (the MLP half's GELU reads a view of it), the q, k, v
// copy 3H, q and k after the rotary step 2H, attention's output H, GELU's output M, the
// concatenation linear2 reads H + M, linear2's output H: b (13H + 3M); then 32H, 4 heads and
// one LayerNorm's 8 as above. With the fused kernel: the LayerNorm's input H, the modulated
// input H, linear1's output 3H + M (the kernel's input), the kernel's q, k and v 3H,
// attention's output H, GELU's output M, the concatenation H + M, linear2's output H:
// b (11H + 3M), no f32 copies.
inline uint64_t SingleStreamTapePerToken(uint64_t h, uint64_t m, uint64_t b, uint64_t heads,
                                         bool fused) {
  return b * ((fused ? 11 : 13) * h + 3 * m) + QkF32Copies(h, fused) + 4 * heads + 8;
}

// One job's shape in a DiT estimate: its adapter and its step's tokens.
struct DitJob {
  std::string name;
  int64_t lora_params = 0;
  int64_t batch = 1;
  int64_t image_tokens = 0;          // of the largest bucket
  int64_t text_tokens = 0;           // of the longest caption
  int64_t lora_rank = 0;             // its adapter's rank (a taped unit keeps each linear's A x)
  bool eight_bit_optimizer = false;  // 8-bit AdamW moments (optim.type = "adamw8bit")
};

// Whether every job of `group` has `job`'s shape (batch, tokens, adapter size and rank): a
// group whose jobs may run stacked, as one batch.
bool SameDitShapes(const DitJob& job, const std::vector<DitJob>& group);

// What a family's units weigh and keep, the same for every job of a group.
struct DitMemoryModel {
  std::vector<int> unit_kind;            // each unit's kind, 0..kind_names.size()-1
  std::vector<std::string> kind_names;   // "double", "single"; one kind: its blocks
  std::vector<uint64_t> unit_bytes;      // each unit's bytes as copied
  std::vector<uint64_t> expanded_bytes;  // of a compressed store (else empty)
  uint64_t rest_bytes = 0;               // the tensors outside the units, on the device
  uint64_t reserve_bytes = uint64_t{512} << 20;
  uint64_t checkpoint_per_token = 0;         // every unit's input streams
  uint64_t table_per_token = 0;              // the rotary table
  bool table_per_latent = true;              // false: one table for the batch (T rows)
  uint64_t forward_per_token = 0;            // one unit's forward without grad
  std::vector<uint64_t> backward_per_token;  // each unit's recompute+backward
  uint64_t stream_grads_per_token = 0;       // the streams' gradients
  // A taped unit's activations per token (DualStreamTapePerToken, SingleStreamTapePerToken:
  // a unit of c blocks c times); its LoRA's per token and unit of rank: b x its token-wise
  // linears (each keeps rank elements of A x per token when adapted: counted as if every one
  // is); its attentions.
  std::vector<uint64_t> tape_per_token;
  std::vector<uint64_t> tape_lora;
  std::vector<uint64_t> tape_attentions;
  int64_t heads = 0;
  uint64_t score_bytes = 0;    // per materialised score; 0: fused attention (log-sum-exp)
  bool group_stacked = false;  // a group's jobs run as one batch (their working sets add up)
  // Names in refusals: the budget's key ("stream.gpu_memory_budget"), what lowers the
  // activations ("train.batch_size"), the family ("FLUX").
  std::string budget_key, batch_key, family;
};

struct DitMemoryEstimate {
  uint64_t rest = 0, resident = 0, ring = 0, adapter = 0, checkpoints = 0, forward_working = 0,
           backward_working = 0, attention = 0, reserve = 0;
  int taped = 0;                // taped units
  uint64_t tapes = 0;           // their activations, every job's
  uint64_t first_backward = 0;  // of those, the part the first backward unit frees (0 when
                                // that unit is not taped)
  uint64_t slot = 0;            // one slot: the largest streamed unit (0: none streams)
  uint64_t expansion = 0;       // a compressed store's one expansion scratch (its largest unit's)
  uint64_t fixed() const { return rest + resident + expansion + adapter + checkpoints + reserve; }
  uint64_t forward() const { return fixed() + ring + forward_working + attention + tapes; }
  uint64_t backward() const {
    return fixed() + ring + backward_working + attention + tapes - first_backward;
  }
  uint64_t total() const { return std::max(forward(), backward()); }
  std::string Describe() const;  // "rest 0.1 GiB + resident 7.2 GiB + ..."
};

// `job` alone (group empty), or with a group's other jobs.
DitMemoryEstimate EstimateDitMemory(const DitMemoryModel& m, const DitJob& job,
                                    const std::vector<DitJob>& group, const ResidencyPlan& plan);

// `streamed[k]` units of kind k streamed (each kind's resident units spread over its depth),
// through a ring of min(ring, streamed) slots (at least 1); the last `taped` resident units
// taped (ResidencyPlan::tape_resident_only; at most the resident ones).
ResidencyPlan DitResidency(const DitMemoryModel& m, const std::vector<int>& streamed, int ring,
                           int taped = 0);
// `plan` with as many of its last resident units taped as fit `budget_bytes` in the estimate
// (none when even one does not, and none of a compressed store's: their expanded weights
// share one scratch).
ResidencyPlan DitFillTapedUnits(const DitMemoryModel& m, const DitJob& job,
                                const std::vector<DitJob>& group, ResidencyPlan plan,
                                uint64_t budget_bytes);
// Every unit streamed through one slot: the smallest plan.
ResidencyPlan DitSmallestPlan(const DitMemoryModel& m);

// "" when `job` with `group` fits `budget_bytes` under the smallest plan; else which job does
// not fit beside the ones before it and by how much (figures in bytes).
std::string DitGroupBudgetRefusal(const DitMemoryModel& m, const DitJob& job,
                                  const std::vector<DitJob>& group, uint64_t budget_bytes);

// A job's `stream.taped_blocks` (the LLMs' key and meaning, common/job/job_spec.h) on `plan`: 0
// keeps the plan's (none for a job's own plan, the planner's choice within a budget); N > 0
// tapes the last N resident units (all of them when fewer are resident; none of a compressed
// store's); -1 as many as fit `budget_bytes`, or without a budget (0) within the plan's own
// estimated peak. Below -1: Error(kRefused) naming `key`.
ResidencyPlan DitApplyTapedUnits(const DitMemoryModel& m, const DitJob& job,
                                 const std::vector<DitJob>& group, ResidencyPlan plan,
                                 uint64_t budget_bytes, int64_t taped, const std::string& key);

// Every split of the streamed units between the kinds, with rings 1..max_ring, each as it is
// and with as many taped units as fit (DitFillTapedUnits): of those whose estimate fits
// `budget_bytes`, the ones predicted within kPlanTieFraction of the fastest,
// then the one copying the fewest bytes, then the lowest peak (PickPlan). The candidates kept
// for the table: per streamed-unit count the best of its splits and rings (the chosen one
// among them). Error(kRefused) naming m.budget_key, the budget and the minimum when nothing
// fits.
PlanChoice ChooseDitPlan(const DitMemoryModel& m, const DitJob& job,
                         const std::vector<DitJob>& group, const StepCosts& costs,
                         uint64_t budget_bytes, int max_ring = 3);

// A job's plan: within `budget_bytes` (> 0) ChooseDitPlan's choice, a group (`group` not empty)
// that does not fit even its smallest plan refused first naming the job (DitGroupBudgetRefusal,
// Error kRefused); without a budget `hand` (the job file's plan) as the one candidate, with its
// estimate and prediction. Either with the job's stream.taped_blocks `taped` applied
// (DitApplyTapedUnits: 0 keeps it as it is).
PlanChoice PlanDitJob(const DitMemoryModel& m, const DitJob& job, const std::vector<DitJob>& group,
                      const StepCosts& costs, uint64_t budget_bytes, const ResidencyPlan& hand,
                      int64_t taped = 0);

// What a family's job feeds the planner: its units' model and the jobs' shapes (a group's
// other jobs in `group`).
struct DitPlanInputs {
  DitMemoryModel model;
  DitJob job;
  std::vector<DitJob> group;
};
// The planning of a diffusion family's job, the one flow every family runs. Without a budget
// (0) and not `predict`ing: the job file's plan `hand` with its `taped` units (-1: as many as
// fit its estimate; `inputs` asked only then). Otherwise the cost model's figures, measured
// by the family: `measure_job(k)` the job's step with k times its batch (1: the job alone; a
// group stacked as one batch: every job's samples at once, StackedGroupCosts), and where the
// group does not stack `measure_members()` each other job's step alone (every job's compute,
// the copies once: GroupStepCosts); then PlanDitJob within `budget_bytes`.
struct DitPlanning {
  ResidencyPlan plan;
  PlanChoice choice;  // empty without a budget unless predicted
  StepCosts costs;
};
DitPlanning PlanDitUnits(uint64_t budget_bytes, bool predict, const ResidencyPlan& hand,
                         int64_t taped, const std::function<DitPlanInputs()>& inputs,
                         const std::function<StepCosts(int64_t)>& measure_job,
                         const std::function<std::vector<StepCosts>()>& measure_members);

// "swap 20 (double 4, single 16) ring 2" (several kinds), "swap 20 ring 2" (one); then
// " taped 3" when units are taped.
std::string DitPlanLabel(const DitMemoryModel& m, const ResidencyPlan& plan);

// A planning's table: the budget ("no budget: the job's plan" for 0) and the bandwidth; per
// candidate its label, resident units, predicted step, copied bytes and their PCIe floor
// (bytes / bandwidth), stall, estimated peak and whether it fits; the chosen plan, its
// prediction and the resident step's; its estimate (Describe()); a plan-summary line.
std::string DescribeDitPlanning(const DitMemoryModel& m, const DitJob& job,
                                const std::vector<DitJob>& group, const PlanChoice& choice,
                                const StepCosts& costs, uint64_t budget);

}  // namespace lorastream::worker
