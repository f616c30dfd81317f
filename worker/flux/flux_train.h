// Training a FLUX.1 LoRA adapter from cached latents and text-encoder outputs
// (`lorastream-worker train JOB.toml...` with a [flux] section, common/flux_job.h): the
// base read once and packed per streaming unit, the units resident or streamed through the
// ring (StreamEngine, the LLMs' engine), checkpointed per unit; per step a batch of one
// bucket, noise and sigmas from the step's own seed (a function of the job's seed and the
// step: a run is reproducible and its steps independent), rectified-flow loss, AdamW with
// clipping, the adapter saved in kohya and diffusers formats. Checkpoints (every save_every
// steps, at a stop and at the end) and resume: worker/flux/flux_checkpoint.h.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "common/flux_job.h"
#include "common/job_spec.h"
#include "common/step_stats.h"
#include "common/user_access.h"
#include "worker/stream/stream_engine.h"

namespace lorastream::worker::flux {

// What a FLUX job group shares (worker/flux/flux_group.h); a job trained alone is a group of one.
struct FluxGroupOptions {
  std::string device = "cpu";
  int threads = 0;             // CPU threads (0: every core)
  StreamEngineOptions engine;  // debug options for tests (poison, delays)
  bool resume = true;          // continue from output_dir's newest checkpoint (flux_checkpoint.h)
  // Who OUTPUT_DIR/.lorastream.lock says holds the folder while the job trains (TrainOptions'
  // rule, common/job_access.h: a later attempt of the same job takes it over and this one
  // stops before it writes again); "": "lorastream-worker pid N". A group's job may name its
  // own (GroupJob::lock_holder).
  std::string lock_holder;
  // A root worker running another user's job: its checkpoint, caches and output folder are
  // opened as this user (common/acting_as.h); a store is the worker's own to attach.
  const UserIdentity* files_as = nullptr;
  // A group's jobs besides the first, known when it forms (`train A.toml B.toml`): a budget
  // (flux.gpu_memory_budget) plans for their memory and compute too, and a group that cannot
  // fit is refused naming the job.
  std::vector<JobSpec> plan_group;
};

struct FluxTrainOptions : FluxGroupOptions {
  const std::atomic<int>* stop = nullptr;  // set: save and stop at the next step boundary
  // After each step, before its checkpoint (tests stop a run here; a serving worker reports
  // the step). An exception thrown here ends the job without saving.
  std::function<void(const StepStats&)> on_step;
};

struct FluxTrainResult {
  int64_t first_step = 0;  // steps done before this run (a resume's checkpoint)
  // This run's; none when the checkpoint resumed from is at or past flux.steps (the job was
  // already complete: nothing is trained or written).
  std::vector<StepStats> steps;
  std::string checkpoint_dir;  // the last checkpoint saved
  // The final adapters in output_dir, once the job's last step is done ("" when stopped).
  std::string kohya_path, diffusers_path;
};

// The job alone: a group of one (worker/flux/flux_group.h). Errors that keep it from starting
// (a bad cache, a locked output folder, a checkpoint of other settings) are thrown.
FluxTrainResult TrainFlux(const FluxJob& job, const FluxTrainOptions& options);

// The command (`lorastream-worker train FLUX.toml...`): loads the job files, trains them as one
// group (each step logged), prints how each ended; returns the exit code: 0, 128 + the signal
// that stopped them (their checkpoints saved), or 1 when a job of several failed.
int RunFluxTrainCommand(const std::vector<std::string>& job_paths, const FluxTrainOptions& options);

}  // namespace lorastream::worker::flux
