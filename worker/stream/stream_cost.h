// The streaming planner's cost model (torch-free): predicts a plan's step time from figures
// measured on the worker's own device (worker/train/stream_calibrate.h measures them), and chooses
// from a memory budget the plan (resident set, ring, slots per phase) with the smallest
// predicted step among those whose estimated peak fits.
//
// The prediction replays the engine's steady pass plan (PlanSteadyPass, then two more passes)
// on two resources, as the device runs it: one compute stream and one copy engine (FIFO).
//   - a use computes once the compute stream is free and its block's copy has landed; a
//     taped block's backward takes its recompute+backward less its forward;
//   - a copy starts once the copy engine is free and its slot's last reader has finished
//     (the release it is issued after; a deferred copy: the compute point of its acquire);
//   - between the forward and the backward the compute stream runs the LM head and loss
//     (head_seconds); a streamed LM head is copied first (issued when the forward's last
//     block is done, or at PassPlan::head_copy_after, behind the copies before it; the head
//     waits for it); after the
//     backward, the optimizer and the rest of the step (tail);
//   - a compressed block's use that expands it adds its expansion to the use's compute.
// Host-side launch time is taken as hidden behind the device's work.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "worker/stream/stream_budget.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker {

// Per step at the job's token count (batch x sequence of one micro-batch).
struct StepCosts {
  double block_forward_seconds = 0;   // one block's forward without grad
  double block_backward_seconds = 0;  // one block recomputed with grad and its backward
  double head_seconds = 0;            // embedding, final norm, LM head, loss and their backward
  double tail_seconds = 0;            // optimizer step and the rest of the step
  double h2d_bytes_per_second = 0;    // measured Host->Device bandwidth of a block copy
  // A compressed store's block expanded on the device (worker/model/quant_expand.h), once per
  // use that expands: each use but the turnaround's second (the forward's last block is the
  // backward's first), resident or streamed. 0: the blocks are plain.
  double block_expand_seconds = 0;
  // Blocks whose compressed bytes differ (FLUX.1's units): block i expands in
  // block_expand_scale[i] times block_expand_seconds. Empty: every block 1.
  std::vector<double> block_expand_scale;
  // A step that streams nothing replays a CUDA graph (worker/train/micro_batch_runner.h) in this
  // fraction of the eager step the figures above add up to: measured, 1 without graphs.
  double graph_factor = 1;
  // Blocks of several sizes (FLUX.1's units: a double-stream block, two single-stream ones):
  // block i computes block_scale[i] times the block figures above. Empty: every block 1.
  std::vector<double> block_scale;

  double ResidentStepSeconds(int num_blocks) const;
  std::string Describe() const;  // "fwd 2.31 ms, bwd 4.70 ms, head 30.1 ms, ... 55.3 GB/s"
};

// A job group's costs (worker/train/group_trainer.h) from each job's, measured alone: every
// block, head and tail figure the sum of the jobs' (each job's compute is its own; the shared
// base GEMMs make the group's step somewhat faster than that sum: measured on an H200, four
// 512-token jobs resident 0.89x of it, two 2048-token jobs 1.00x), the copies and the block
// expansion once (the first job's bandwidth and expansion), the CUDA graph factor and the
// block scales the first job's. Throws on an empty list.
StepCosts GroupStepCosts(const std::vector<StepCosts>& jobs);
// A stacked group's costs (jobs of one shape run as one batch, worker/model/dit_ops.h): the
// block and head figures `stacked`'s, measured once over every job's samples as one batch;
// the tail `jobs` times `one`'s (each job's optimizer step); the rest `one`'s, the first job's
// measured alone.
StepCosts StackedGroupCosts(const StepCosts& one, const StepCosts& stacked, size_t jobs);

// The block and tail costs of `costs` from two measured resident steps, of `deep` and of
// `half` < deep blocks, and its head_seconds: a block costs the steps' difference per block
// (split between its forward and its recompute+backward by `forward_share`), the tail is
// what the short step leaves. The deep step is reproduced exactly (deep x block + head +
// tail). Where the short step is faster per block than that difference (steps bound by
// issuing kernels, at short lengths) the tail would be negative: then it is `tail_floor`
// (0: none), and a block costs the deep step's share of what is left. `tail_floor`: the
// step's tail measured alone (the gradient clipping and the optimizer over every adapter
// tensor), which runs after the last block whatever the difference says: the tail is at
// least that (at most the deep step less its head).
void SplitMeasuredSteps(double deep_step, int deep, double short_step, int half,
                        double forward_share, StepCosts* costs, double tail_floor = 0);

struct PredictedStep {
  double step_seconds = 0;
  double copy_busy_seconds = 0;  // the copy engine's busy time in the step
  double stall_seconds = 0;      // compute waiting for copies
  uint64_t h2d_bytes = 0;        // bytes copied per step
};

// The steady-state step of `plan` (one pass per step) under `costs`; block_bytes[i]: the
// bytes of block i's copy; head_bytes: the LM head's copy when the plan streams it. A plan
// that streams nothing takes costs.graph_factor of it.
PredictedStep PredictStep(const ResidencyPlan& plan, const std::vector<uint64_t>& block_bytes,
                          const StepCosts& costs, uint64_t head_bytes = 0);

// An optimizer step of `grad_accum` micro-batches, each one pass of `pass_seconds`
// (PredictStep's step_seconds), with the step's tail (the optimizer) once.
double OptimizerStepSeconds(double pass_seconds, const StepCosts& costs, int64_t grad_accum);

struct CandidatePlan {
  ResidencyPlan plan;
  uint64_t peak_bytes = 0;  // EstimateMemory(...).total()
  PredictedStep predicted;
  bool fits = false;          // peak_bytes <= the budget
  std::string Label() const;  // "swap 12 ring 2 fwd 7 bwd 6"
};

// Predicted steps closer than this fraction are ties for the planner.
inline constexpr double kPlanTieFraction = 0.01;

struct PlanChoice {
  std::vector<CandidatePlan> candidates;  // every plan considered, fitting or not
  int chosen = -1;                        // index into candidates
};

// The planner's rule, for every family's candidates: of the fitting plans predicted within
// kPlanTieFraction of the fastest, the one copying the fewest bytes, then with the fewest
// slots, then the lowest peak, then the faster. -1 when none fits.
int PickPlan(const std::vector<CandidatePlan>& candidates);

// Candidates: every streamed-block count (resident blocks spread as PlanFromSwapCount
// spreads them) with rings 1..max_ring, each both as it is (one ring for the whole step, the
// hand-picked kind) and with the budget's headroom filled with phase slots, with taped blocks
// (FillTapedBlocks), or with both in either order, each with the LM head resident and (when
// inputs.head_bytes > 0) streamed. Chosen: of the plans that fit and
// are predicted within kPlanTieFraction of the fastest of them, the one copying the fewest
// bytes, then with the fewest slots, then the lowest peak. Error(kRefused) when none fits,
// naming the minimum.
PlanChoice ChoosePlan(const MemoryModelInputs& inputs, const StepCosts& costs,
                      uint64_t budget_bytes, int max_ring = 4);

// The candidates as a table (one line each: label, resident blocks, slots, predicted ms,
// copied GB, peak GiB, fits), the chosen one marked.
std::string DescribeChoice(const PlanChoice& choice, uint64_t budget_bytes);

// The calibration cache: one JSON file per model, device and token count under
// $LORASTREAM_CACHE_DIR, else $XDG_CACHE_HOME/lorastream, else ~/.cache/lorastream
// (calibration/KEY.json). Load returns false when there is none (or it is unreadable: a
// damaged cache file is measured again, never trusted).
std::string CalibrationCachePath(const std::string& key);
bool LoadStepCosts(const std::string& key, StepCosts* costs);
void SaveStepCosts(const std::string& key, const StepCosts& costs);

}  // namespace lorastream::worker
