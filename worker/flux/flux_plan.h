// Planning a FLUX job's streaming from a GPU memory budget (torch-free): its units are of two
// sizes (FLUX.1-dev in bf16: a double-stream block 648 MiB, a unit of two single-stream
// blocks 540 MiB), so the planner chooses how many of each kind stream, the ring's size
// (a slot holds the largest streamed unit: streaming single units only makes every slot
// smaller) and which units stay resident, from the units' real byte sizes, an estimate of the
// activations at the job's resolution and a cost model measured on the device
// (worker/flux/flux_calibrate.h).
//
// The estimate per step (B images of N image tokens and L text tokens, T = N + L, H hidden,
// M MLP width, b bytes per compute element, P LoRA parameters):
//   weights      rest (embedders, final layer) + resident units + R x (largest streamed unit);
//                a compressed store's units as stored (resident and in slots), every use
//                expanding its linears into one scratch of the largest unit's (compute dtype)
//   adapter      P x 16 (f32 master weights, gradients and AdamW's two moments)
//   checkpoints  units x B T H b: each unit's input streams, kept by the checkpointed units,
//                plus the rotary table (B T head_dim x 8: f32 [.., 2, 2] pairs)
//   forward      one unit's forward without grad: B T (b (6H + 2M) + 32 H) per block
//   backward     one unit recomputed with grad and its backward, the largest of the units:
//                B T (b (20H + 4M) + 32H) per double block, B T (b (15H + 5M) + 32H) per
//                single block (a unit of c single blocks: c of them, one graph), plus the
//                streams' gradients 2 B T H b; the 32H are the f32 copies of q and k that
//                the RMSNorm and rotary steps make
//   attention    fused kernels: B heads T x 8 (log-sum-exp); where attention materialises
//                its scores (LibTorch 1.13, the CPU): B heads T^2 x 2b
//   reserve      allocator slack
// peak = max(forward phase, backward phase), each fixed + ring + its working set + attention.
// It is an estimate: the benchmark prints the measured peak next to it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/flux_config.h"
#include "worker/stream/stream_cost.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker::flux {

// A job of a group besides the one a FluxMemoryInputs describes: its own adapter and batch.
struct FluxGroupMember {
  std::string name;
  int64_t lora_params = 0;
  int64_t batch = 1;
  int64_t image_tokens = 0;
  int64_t text_tokens = 0;
};

struct FluxMemoryInputs {
  FluxConfig config;
  std::vector<FluxUnit> units;       // FluxUnits(config, singles_per_unit)
  std::vector<uint64_t> unit_bytes;  // each unit's bytes as copied (compute dtype, or compressed)
  // Of a compressed store: each unit's linears expanded, in bytes of the compute dtype
  // (worker/model/quant_expand.h); empty: the units are plain.
  std::vector<uint64_t> expanded_bytes;
  uint64_t rest_bytes = 0;  // the tensors outside the blocks, on the device
  int64_t lora_params = 0;  // A and B of every adapted module
  int64_t batch = 1;
  int64_t image_tokens = 0;  // of the largest bucket: (H / 16) (W / 16)
  int64_t text_tokens = 0;   // T5 tokens per caption (512 for FLUX.1-dev)
  int compute_bytes = 2;     // 2: bf16; 4: f32
  bool attention_materialized = false;
  uint64_t reserve_bytes = uint64_t{512} << 20;
  // A job group's other jobs (worker/flux/flux_group.h): the estimate adds their adapters,
  // checkpoints and streams' gradients; their working sets take turns with this job's
  // (FluxGroupMemory).
  std::vector<FluxGroupMember> group;
};

struct FluxMemoryEstimate {
  uint64_t rest = 0, resident = 0, ring = 0, adapter = 0, checkpoints = 0, forward_working = 0,
           backward_working = 0, attention = 0, reserve = 0;
  uint64_t slot = 0;       // one slot: the largest streamed unit (0: none streams)
  uint64_t expansion = 0;  // a compressed store's one expansion scratch (its largest unit's)
  uint64_t fixed() const { return rest + resident + expansion + adapter + checkpoints + reserve; }
  uint64_t forward() const { return fixed() + ring + forward_working + attention; }
  uint64_t backward() const { return fixed() + ring + backward_working + attention; }
  uint64_t total() const { return std::max(forward(), backward()); }
  std::string Describe() const;  // "rest 0.1 GiB + resident 12 units 7.2 GiB + ..."
};

FluxMemoryEstimate EstimateFluxMemory(const FluxMemoryInputs& in, const ResidencyPlan& plan);

// A group's estimate (in.group not empty): the weights, ring and reserve once, each job's
// adapter, checkpoints and streams' gradients, and the largest job's working set and
// attention (a unit runs, and is recomputed with its backward, for one job after another).
void AddFluxGroupMemory(const FluxMemoryInputs& in, const ResidencyPlan& plan,
                        FluxMemoryEstimate& e);

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

// Every split of the streamed units between the kinds, with rings 1..max_ring: of those whose
// estimate fits `budget_bytes`, the ones predicted within kPlanTieFraction of the fastest,
// then the one copying the fewest bytes, then the lowest peak. The candidates kept for the
// table: per streamed-unit count the best of its splits and rings (the chosen one among
// them). Error(kRefused) naming flux.gpu_memory_budget and the minimum when nothing fits.
PlanChoice ChooseFluxPlan(const FluxMemoryInputs& in, const StepCosts& costs, uint64_t budget_bytes,
                          int max_ring = 3);

// "swap 20 (doubles 4, singles 16) ring 2" for a FLUX plan.
std::string FluxPlanLabel(const FluxMemoryInputs& in, const ResidencyPlan& plan);

}  // namespace lorastream::worker::flux
