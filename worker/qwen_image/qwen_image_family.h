// Qwen-Image as a family of the one trainer (worker/train/family.h). A job's part: its caches
// (musubi-tuner's, common/formats/qwen_image_cache.h), per step a batch of one bucket with noise
// and timesteps from the job's seed and the step alone, flow matching, its adapter (ComfyUI and
// diffusers files). The group's part: the base (a checkpoint packed one block per streaming
// unit), the engine (stream.blocks_to_swap through stream.ring_size slots), the model; per
// group step each block is acquired once for the forward of every job and once for the
// checkpointed backward (QwenImageModel::ForwardGroup).
#pragma once

#include <functional>
#include <memory>

#include "common/job/job_spec.h"
#include "worker/serve/plan_command.h"
#include "worker/train/family.h"
#include "worker/train/trainer.h"

namespace lorastream::worker::qwen_image {

// Whether `spec` is a Qwen-Image job (a [qwen_image] section).
bool Accepts(const JobSpec& spec);

// `lorastream-worker plan` of Qwen-Image jobs: per job, the blocks it streams and the memory
// its base takes on the device and in host memory.
int RunPlan(const std::vector<std::string>& job_paths, const PlanCommandOptions& options);

std::unique_ptr<FamilyGroup> MakeGroup(const JobSpec& first, const TrainOptions& options,
                                       std::function<bool()> all_stop);

}  // namespace lorastream::worker::qwen_image
