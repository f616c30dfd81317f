// The FLUX planner's inputs measured and computed for a job (worker/flux/flux_plan.h): the
// units' byte sizes and the activation sizes at the job's largest bucket, and the cost model's
// figures measured on the job's device: one double unit and one single unit, resident, run
// as the trainer runs them (forward without grad; recomputed with grad and its backward) on
// random streams of the job's tokens, a few repetitions each after a warm-up; the optimizer
// step over the job's adapter; the Host->Device bandwidth of a unit's copy. Seconds on a GPU.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "common/job/flux_job.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_data.h"
#include "worker/flux/flux_plan.h"
#include "worker/stream/stream_cost.h"

namespace lorastream::worker::flux {

FluxMemoryInputs FluxMemoryInputsFor(const FluxBase& base, const FluxJob& job,
                                     const FluxDataset& data, c10::Device device,
                                     c10::ScalarType dtype);

// FluxMemoryModel(in) for `job`: its planner refusals name the budget and batch keys as the
// job's file writes them (FluxKeyName: flux.gpu_memory_budget, or stream.gpu_memory_budget
// in the shared form).
DitMemoryModel FluxJobMemoryModel(const FluxMemoryInputs& in, const FluxJob& job);

// block_scale is set for `in`'s units (FluxBlockScale).
StepCosts MeasureFluxCosts(const FluxBase& base, const FluxJob& job, const FluxMemoryInputs& in,
                           const FluxDataset& data, c10::Device device, c10::ScalarType dtype);

// The plan for a job: with a budget (flux.gpu_memory_budget, or "auto": JobMemoryBudget) the
// planner's choice (calibrated here, the table logged); without one, blocks_to_swap and
// ring_size as given, its prediction and estimate computed (calibrated) only when `predict`
// (the plan command), else an empty table.
struct FluxPlanning : DitPlanning {
  FluxMemoryInputs inputs;
  uint64_t budget = 0;
};
// A job group's other jobs, for the plan of its first (worker/flux/flux_group.h): their
// memory (FluxMemoryInputs::group) and their measured costs, which a group's step adds.
struct FluxPlanGroup {
  std::string first_name;  // the planned job's, for a refusal
  std::vector<FluxGroupMember> members;
  // Each member's costs (MeasureFluxCosts), measured only for a group that does not stack
  // (a stacked group's step is measured as one batch of every job's samples instead).
  std::function<std::vector<StepCosts>()> member_costs;
};
// With `group` (not empty) and a budget, a group that does not fit even with every unit
// streamed is refused naming the job (FluxGroupBudgetRefusal).
FluxPlanning PlanFluxJob(const FluxBase& base, const FluxJob& job, const FluxDataset& data,
                         c10::Device device, c10::ScalarType dtype, bool predict = false,
                         const FluxPlanGroup& group = {});

// The table of a planning (DescribeFluxChoice): per candidate its label, resident units,
// predicted step, copied bytes and their PCIe floor (bytes / bandwidth), stall, estimated peak
// and whether it fits; then the chosen plan's memory estimate, and the resident step predicted.
std::string DescribeFluxPlanning(const FluxPlanning& p);

// `lorastream-worker plan FLUX_JOB.toml --device D`: prints DescribeFluxPlanning.
int RunFluxPlanCommand(const std::string& job_path, const std::string& device);

}  // namespace lorastream::worker::flux
