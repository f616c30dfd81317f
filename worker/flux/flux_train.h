// Training a FLUX.1 LoRA adapter from cached latents and text-encoder outputs
// (`lorastream-worker train JOB.toml` with a [flux] section, common/flux_job.h): the
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
#include "common/step_stats.h"
#include "common/user_access.h"
#include "worker/stream/stream_engine.h"

namespace lorastream::worker::flux {

struct FluxTrainOptions {
  std::string device = "cpu";
  int threads = 0;                         // CPU threads (0: every core)
  StreamEngineOptions engine;              // debug options for tests (poison, delays)
  const std::atomic<int>* stop = nullptr;  // set: save and stop at the next step boundary
  bool resume = true;  // continue from output_dir's newest checkpoint (flux_checkpoint.h)
  // After each step, before its checkpoint (tests stop a run here; a serving worker reports
  // the step). An exception thrown here ends the job without saving.
  std::function<void(const StepStats&)> on_step;
  // Who OUTPUT_DIR/.lorastream.lock says holds the folder while the job trains (TrainOptions'
  // rule, common/job_access.h: a later attempt of the same job takes it over and this one
  // stops before it writes again); "": "lorastream-worker pid N".
  std::string lock_holder;
  // A root worker running another user's job: its checkpoint, caches and output folder are
  // opened as this user (common/acting_as.h); a store is the worker's own to attach.
  const UserIdentity* files_as = nullptr;
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

FluxTrainResult TrainFlux(const FluxJob& job, const FluxTrainOptions& options);

// The command: loads the job file, trains (each step logged), prints how it ended; returns
// the exit code: 0, or 128 + the signal that stopped it (its checkpoint saved).
int RunFluxTrainCommand(const std::string& job_path, const FluxTrainOptions& options);

}  // namespace lorastream::worker::flux
