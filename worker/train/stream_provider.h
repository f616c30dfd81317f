// The streaming engine as the trainer's BlockProvider for a job (a TrainOptions::make_provider
// factory): plans the residency from the job's [stream] section and serves the blocks.
//
//   TrainOptions options;
//   options.make_provider = [](const JobSpec& spec, const BaseWeights& base,
//                              const std::string& device, const std::string& dtype) {
//     return MakeStreamProvider(spec, base, device, dtype);
//   };
//
// With a store as the base, blocks stream straight from the store's read-only shared memory.
// With a checkpoint folder as the base, or when the stored dtype differs from the compute
// dtype, the blocks are first packed (converted) once into host buffers this provider owns,
// laid out as a store lays them out.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

#include "worker/model/block_provider.h"
#include "worker/stream/stream_cost.h"
#include "worker/stream/stream_engine.h"

namespace lorastream {
struct JobSpec;
struct StreamSpec;
}  // namespace lorastream

namespace lorastream::worker {

class BaseWeights;

// device: "cpu" | "cuda" | "cuda:N"; dtype: "f32" | "bf16" (the compute dtype). Refusals
// (kRefused) name the [stream] field at fault; the plan is logged.
// The memory-model inputs of a job on `device` in the compute dtype `dtype`, from the
// layout its blocks are streamed in (ComputeLayout).
MemoryModelInputs JobMemoryInputs(const JobSpec& spec, const Manifest& manifest,
                                  const c10::Device& device, c10::ScalarType dtype);
// The group's other jobs into `inputs` (MemoryModelInputs::group): their tokens per
// micro-batch, rank, dropout and targets.
void AddGroupJobs(const std::vector<JobSpec>& others, MemoryModelInputs* inputs);

// The layout the engine streams the base's blocks in: the store's manifest when its dtype is
// the compute dtype or its blocks are compressed (with the compute dtype, which they expand
// into), else the layout of the packed copy (no packing done here).
Manifest ComputeLayout(const BaseWeights& base, c10::ScalarType dtype);

struct StreamPlanning {
  ResidencyPlan plan;
  double predicted_step_seconds = 0;  // the cost model's prediction; 0: none made
  uint64_t budget = 0;                // the budget it was planned within (JobMemoryBudget)
};

// The device's memory (the host's on the CPU) in bytes, and its name in messages ("cuda:0",
// "the host's memory (cpu)"); 0 where it cannot be known (CUDA in a build without it).
std::pair<uint64_t, std::string> DeviceMemory(const c10::Device& device);

// The job's memory budget in bytes (0: none, plan from blocks_to_swap):
// stream.gpu_memory_budget, or with stream.budget_auto on a GPU AutoMemoryBudget of the
// memory free on `device` now (logged); on the CPU auto means none.
uint64_t JobMemoryBudget(const StreamSpec& stream, const c10::Device& device);
// The same from a budget's two settings (a family section that keeps them itself: [flux]).
uint64_t JobMemoryBudget(uint64_t gpu_memory_budget, bool budget_auto, const c10::Device& device);

// The job's plan: from blocks_to_swap (and its phase slots) without a budget
// (JobMemoryBudget); with one (a group's: inputs.group, refused naming the job that does not
// fit when the whole group cannot, GroupBudgetRefusal), the
// cost model's choice (calibrated on `device`, worker/train/stream_calibrate.h), the candidates
// logged at debug level and the choice with its prediction at info level.
// `group`: the group's other jobs, whose measured costs the prediction adds (JobGroupCosts).
StreamPlanning PlanJobStream(const JobSpec& spec, const BaseWeights& base,
                             const MemoryModelInputs& inputs, const c10::Device& device,
                             c10::ScalarType dtype, const std::vector<JobSpec>& group = {});

// The group's costs (GroupStepCosts): the first job's, `first`, with those of the group's other
// jobs `others`, each calibrated on `device` at its own shape (worker/train/stream_calibrate.h).
StepCosts JobGroupCosts(const StepCosts& first, const std::vector<JobSpec>& others,
                        const BaseWeights& base, const c10::Device& device, c10::ScalarType dtype);

// Refuses (kRefused) a group (`inputs` with its group) that does not fit `budget_bytes` under
// its smallest plan, naming the job (GroupBudgetRefusal; `first_name` is inputs' own job).
void RefuseGroupBeyondBudget(const MemoryModelInputs& inputs, uint64_t budget_bytes,
                             const std::string& first_name);

// `group`: the other jobs of a group (TrainOptions::plan_group), planned for with `spec`.
std::unique_ptr<BlockProvider> MakeStreamProvider(const JobSpec& spec, const BaseWeights& base,
                                                  const std::string& device,
                                                  const std::string& dtype,
                                                  const StreamEngineOptions& options = {},
                                                  const std::vector<JobSpec>& group = {});

}  // namespace lorastream::worker
