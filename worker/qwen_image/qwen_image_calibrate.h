// The Qwen-Image planner's inputs for a job (worker/qwen_image/qwen_image_plan.h): the blocks'
// byte sizes from the checkpoint's manifest, the job's tokens from its cache files' headers,
// and the cost model's figures measured on the job's device: one block, resident, of the
// model's shape (random weights: a block's time does not depend on its values), run as the
// trainer runs it at the job's most tokens (worker/train/calibrate_parts.h); the optimizer step
// over the job's adapter; the Host->Device bandwidth of a block's copy.
#pragma once

#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "common/formats/manifest.h"
#include "common/job/job_spec.h"
#include "worker/qwen_image/qwen_image_plan.h"
#include "worker/stream/stream_cost.h"

namespace lorastream::worker::qwen_image {

// `manifest`: the blocks packed in the compute dtype (QwenImageManifest); `others`: a group's
// other jobs.
QwenImageMemoryInputs QwenImageMemoryInputsFor(const QwenImageConfig& config,
                                               const Manifest& manifest, const JobSpec& spec,
                                               const std::vector<JobSpec>& others,
                                               c10::Device device, c10::ScalarType dtype);

StepCosts MeasureQwenImageCosts(const QwenImageConfig& config, const JobSpec& spec,
                                const QwenImageMemoryInputs& in, c10::Device device,
                                c10::ScalarType dtype);

// The plan for a job (with the group's other jobs given with it, `others`): with a budget
// (JobMemoryBudget: stream.gpu_memory_budget, "auto" on a GPU) the planner's choice,
// calibrated here, a group that does not fit even with every block streamed refused naming
// the job; without one, stream.blocks_to_swap and ring_size as given, with its estimate and
// prediction only when `predict` (the plan command).
struct QwenImagePlanning : DitPlanning {
  QwenImageMemoryInputs inputs;
  uint64_t budget = 0;
};
QwenImagePlanning PlanQwenImageJob(const QwenImageConfig& config, const Manifest& manifest,
                                   const JobSpec& spec, const std::vector<JobSpec>& others,
                                   c10::Device device, c10::ScalarType dtype, bool predict);

// The blocks, tokens and the planning's table (DescribeDitPlanning).
std::string DescribeQwenImagePlanning(const QwenImagePlanning& p);

}  // namespace lorastream::worker::qwen_image
