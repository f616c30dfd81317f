// Training one FLUX.1 LoRA adapter from cached latents and text-encoder outputs, as a library
// call: a group of one of the one trainer (worker/train/group_trainer.h) with the FLUX.1
// family (worker/flux/flux_family.h). `lorastream-worker train JOB.toml...` is the trainer's
// command, whatever the family.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "common/job/flux_job.h"
#include "common/job/job_spec.h"
#include "common/job/step_stats.h"
#include "worker/train/trainer.h"

namespace lorastream::worker::flux {

// What a FLUX job group shares: the one trainer's options (worker/train/trainer.h).
using FluxGroupOptions = TrainOptions;

struct FluxTrainOptions : TrainOptions {
  const std::atomic<int>* stop = nullptr;  // set: save and stop at the next step boundary
  // After each step, before its checkpoint (tests stop a run here; a serving worker reports
  // the step). An exception thrown here ends the job without saving.
  std::function<void(const StepStats&)> on_step;
};

struct FluxTrainResult {
  int64_t first_step = 0;  // steps done before this run (a resume's checkpoint)
  // This run's; none when the checkpoint resumed from is at or past flux.steps (the job was
  // already complete: nothing is trained).
  std::vector<StepStats> steps;
  std::string checkpoint_dir;  // the last checkpoint saved
  // The final adapters in output_dir, once the job's last step is done ("" when stopped).
  std::string kohya_path, diffusers_path;
  // The steps replayed from a CUDA graph (a resident job on CUDA, from its second step while
  // its shapes stay those of the captured one; worker/train/graphed_call.h).
  int64_t graphed_steps = 0;
};

// The job alone: a group of one (worker/flux/flux_group.h). Errors that keep it from starting
// (a bad cache, a locked output folder, a checkpoint of other settings) are thrown.
FluxTrainResult TrainFlux(const FluxJob& job, const FluxTrainOptions& options);

}  // namespace lorastream::worker::flux
