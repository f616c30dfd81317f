// FLUX.1 as a family of the one trainer (worker/train/family.h). A job's part: its caches
// (sd-scripts' latents and text-encoder outputs, common/formats/flux_cache.h), per step a batch of
// one bucket with noise and timesteps drawn from the job's seed and the step alone (a run is
// reproducible and its steps independent), the rectified-flow objective, its adapter
// (FluxAdapter; files in kohya and diffusers formats). The group's part: the base (a store, or
// a checkpoint packed per streaming unit), the engine planned for every job of the group
// (flux.gpu_memory_budget or blocks_to_swap), the model. Per group step each unit is acquired
// once for the forward, where it runs on every job's streams in turn with that job's LoRA, and
// once for the checkpointed backward (FluxModel::ForwardGroup); one backward over the jobs'
// summed losses gives each adapter its own gradients.
#pragma once

#include <functional>
#include <memory>

#include "common/job/job_spec.h"
#include "worker/train/family.h"
#include "worker/train/trainer.h"

namespace lorastream::worker::flux {

// Whether `spec` is a FLUX.1 job (a [flux] section).
bool Accepts(const JobSpec& spec);

std::unique_ptr<FamilyGroup> MakeGroup(const JobSpec& first, const TrainOptions& options,
                                       std::function<bool()> all_stop);

}  // namespace lorastream::worker::flux
