// The streaming engine: a BlockProvider that keeps the resident blocks on the device and
// streams the others Host->Device through a ring of R slots, following the pass plan
// (worker/stream/stream_plan.h). One H2D copy per block (a block's bytes are contiguous in the
// store), issued as soon as the slot's previous occupant has been released, overlapped with
// compute; a block still in its slot is served again without a copy. The forward and the
// backward may hold more slots than the ring (ResidencyPlan's phase slots): the engine frees
// them after their last use in the phase and fills them again in the next one, so the next
// pass's first blocks are fetched during the backward.
//
// Construction: for a job, MakeStreamProvider (worker/train/stream_provider.h) does all of this.
// By hand:
//   ResidencyPlan plan = PlanResidency(job.stream.blocks_to_swap, job.stream.gpu_memory_budget,
//                                      job.stream.ring_size, MemoryInputsFor(manifest, ...));
//   RequireCheckpointingForStreaming(plan, /*gradient_checkpointing=*/true);
//   auto engine = MakeStreamEngine(manifest, block_pointers, plan, device, {});
//   // then, per step: BeginStep, Acquire/Release in the pass order, EndStep(stats)
//
// Order contract: within a pass, Acquire/Release alternate and follow 0..L-1, L-1..0; passes
// repeat (gradient accumulation = several passes between BeginStep and EndStep). A BeginStep
// in the middle of a pass (an aborted step, a forward-only evaluation) drains the copies in
// flight and starts a fresh pass. Any other order is a bug in the caller: Error(kInternal).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <c10/core/Device.h>

#include "common/formats/manifest.h"
#include "worker/model/block_provider.h"
#include "worker/stream/stream_backend.h"
#include "worker/stream/stream_budget.h"
#include "worker/stream/stream_engine_options.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker {

class StreamEngine : public BlockProvider {
 public:
  // block_bytes[i]: host address of block i's packed bytes (manifest.blocks[i].nbytes long;
  // the store's read-only mapping), for every block, resident ones included. They must stay
  // mapped for the engine's life.
  StreamEngine(const Manifest& manifest, std::vector<const uint8_t*> block_bytes,
               ResidencyPlan residency, std::unique_ptr<StreamBackend> backend,
               bool log_plan = true);
  ~StreamEngine() override;
  StreamEngine(const StreamEngine&) = delete;
  StreamEngine& operator=(const StreamEngine&) = delete;

  int num_blocks() const override { return residency_.num_blocks(); }
  void BeginStep() override;
  const BlockWeights& Acquire(int block) override;
  void Release(int block) override;
  void EndStep(StepStats& stats) override;
  // Every block resident: a step issues no copies, events or waits (a CUDA graph may replay it).
  bool step_is_host_only() const override { return residency_.num_streamed() == 0; }

  const ResidencyPlan& residency() const { return residency_; }
  const PassPlan& pass_plan() const { return pass_; }  // the pass in progress
  int next_use() const { return cursor_; }             // the index in pass_plan() of the next use

 private:
  void StartPass();  // plans the pass from the slots' contents and issues its first copies
  void Issue(int use);
  void FreePhaseSlot(int slot);  // drops the views over a phase slot, then its memory
  const BlockUse& Expect(int block, const char* verb) const;

  // The views of a block's bytes; of a compressed block, its plain tensors only (the
  // projections are expanded per use into scratch_).
  BlockWeights WeightsOf(const at::Tensor& bytes, int block) const;

  const std::vector<SegmentInfo> layouts_;
  const c10::ScalarType dtype_;  // of the weights served (a compressed block's expansion)
  const BlockNaming naming_;     // LLM fields, or every tensor by name (FLUX units)
  const std::vector<const uint8_t*> sources_;
  const ResidencyPlan residency_;
  std::unique_ptr<StreamBackend> backend_;

  std::vector<at::Tensor> resident_bytes_;      // [block], defined for resident blocks
  std::vector<BlockWeights> resident_weights_;  // [block]
  std::vector<BlockWeights> slot_weights_;      // [slot]: views over the slot for ...
  std::vector<int> slot_weights_block_;         // ... this block's layout (-1: none yet)
  std::vector<int> slot_block_;                 // block each slot holds once its copies land
  // A compressed block stays compressed on the device, resident or in its slot: its views
  // hold its plain tensors only, and each use expands its projections into the one scratch
  // (as large as the largest block's expansion: a use allocates nothing, and a resident run's
  // captured CUDA graph replays it). Its weights are valid from Acquire until the next block's
  // Acquire, as a slot's are: kernels on the compute stream read the scratch before the next
  // expansion overwrites it. Within a pass, the scratch still holding the block asked for (the
  // forward's last block is the backward's first) is served as it is; a new pass expands
  // afresh (what a captured micro-batch does at every replay, whatever ran between).
  std::vector<bool> compressed_;  // [block]
  int64_t scratch_elements_ = 0;
  at::Tensor scratch_;
  BlockWeights scratch_weights_;
  int scratch_block_ = -1;  // the block scratch_weights_ holds in this pass (-1: none)

  PassPlan pass_;
  int cursor_ = 0;         // index of the next use to Acquire in pass_
  bool acquired_ = false;  // use cursor_ is acquired and not yet released

  // Statistics since the last EndStep.
  uint64_t h2d_bytes_ = 0;
  int64_t copies_ = 0;
  int64_t copies_saved_ = 0;
};

// Base weights are frozen (invariant 3): Error(kRefused) naming the tensor when one requires
// grad. The engine checks every block it serves; the trainer calls the second form for the
// non-block weights.
void RefuseTrainableBaseWeights(const BlockWeights& weights, int block);
void RefuseTrainableBaseWeight(const at::Tensor& weight, const std::string& name);

// The resident/streamed split a job asks for: from the budget when gpu_memory_budget > 0,
// else from blocks_to_swap; then the phase slots: forward_slots / backward_slots of 0 keep
// the budget's choice (ring_size without a budget), -1 fills the phase up to the plan's
// estimated peak (the budget when there is one), N asks for N; then as many of the
// backward's slots as fit across the LM head within the budget, else within the estimated
// peak of the plan with those slots; then the taped blocks (ApplyTapedBlocks). Logs the plan.
// Refusals name the field.
ResidencyPlan PlanResidency(int64_t blocks_to_swap, uint64_t gpu_memory_budget, int64_t ring_size,
                            const MemoryModelInputs& inputs, int64_t forward_slots = 0,
                            int64_t backward_slots = 0, int64_t taped_blocks = 0);

// stream.taped_blocks for a plan: 0 keeps the plan's (none without a budget, the cost model's
// with one), -1 tapes as many of the last blocks as fit within `gpu_memory_budget` (or, without
// one, within the plan's estimated peak), N tapes the last N (at most every block).
ResidencyPlan ApplyTapedBlocks(const MemoryModelInputs& inputs, ResidencyPlan plan,
                               uint64_t gpu_memory_budget, int64_t taped_blocks);

// The same phase-slot rule for a plan made elsewhere (the cost-model planner).
ResidencyPlan ApplyPhaseSlots(const MemoryModelInputs& inputs, ResidencyPlan plan,
                              uint64_t gpu_memory_budget, int64_t forward_slots,
                              int64_t backward_slots);

// Memory-model inputs from the manifest (block sizes), the model's shape (the final norm and
// the LM head on the device; the embedding table in host RAM) and the job's numbers.
MemoryModelInputs MemoryInputsFor(const Manifest& manifest, int64_t lora_rank,
                                  const std::vector<std::string>& lora_targets,
                                  int64_t tokens_per_micro_batch, int compute_bytes,
                                  bool attention_materialized);

// The backend for `device`: CUDA for a CUDA device (builds with CUDA), CPU for the CPU.
// Error(kUnsupported) for a CUDA device in a build without CUDA.
std::unique_ptr<StreamBackend> MakeStreamBackend(const StreamBackendOptions& options,
                                                 const c10::Device& device);

// The backend a plan needs: a slot per ring and phase slot, the ring's slots permanent, each
// as large as the largest streamed block; the debug options passed through.
StreamBackendOptions StreamBackendOptionsFor(const Manifest& manifest,
                                             const ResidencyPlan& residency,
                                             const StreamEngineOptions& options);

// The engine on `device`: the CUDA backend for a CUDA device (builds with CUDA), the CPU
// backend for the CPU. Error(kUnsupported) for a CUDA device in a build without CUDA.
std::unique_ptr<StreamEngine> MakeStreamEngine(const Manifest& manifest,
                                               std::vector<const uint8_t*> block_bytes,
                                               const ResidencyPlan& residency,
                                               const c10::Device& device,
                                               const StreamEngineOptions& options = {});

}  // namespace lorastream::worker
