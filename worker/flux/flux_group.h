// A FLUX.1 job group: up to K FLUX jobs trained at once against one base on one device, sharing
// one streaming engine and one model. Torch-free header.
//
// Per group step each unit is acquired once for the forward, where it runs on every job's
// streams in turn with that job's LoRA, and once for the checkpointed backward, where each
// job's recompute and backward run in turn (FluxModel::ForwardGroup): the group's bytes copied
// per step are one job's. One backward over the jobs' summed losses gives each adapter its own
// gradients. Everything else is the job's own, as worker/flux/flux_train.h describes it for
// one job: caches and their batches, resolution, batch_size, rank, alpha, targets, timestep
// sampling and guidance, noise and timesteps from its seed, AdamW, schedule, clipping by its
// own norm, steps, checkpoints, resume, output lock and statistics. A job trained in a group
// computes what it computes alone (bit for bit on the CPU: its units run on its own rows only).
//
// Jobs join (Add) and leave at step boundaries: a job leaves when it has finished, when its
// should_stop says so (after its checkpoint), or when it fails (bad caches, a non-finite loss,
// an output folder it may not write): its failure is its own and the others train on. A
// failure of the shared work (the engine, the device) ends every job in it.
//
// The jobs of a group share the base (flux.store, or flux.checkpoint with flux.singles_per_unit),
// flux.dtype and the plan (flux.gpu_memory_budget, blocks_to_swap, ring_size): GroupRefusal
// (common/job_group.h) refuses a job that differs, naming the key.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "worker/flux/flux_train.h"
#include "worker/train/group_trainer.h"

namespace lorastream::worker::flux {

// A JobSpec of the FLUX job `job` (is_flux, its base and output mirrored) named `name`.
JobSpec FluxJobSpec(const FluxJob& job, const std::string& name);

class FluxGroupTrainer final : public TrainingGroup {
 public:
  // The base, engine and model from `first` (a FLUX JobSpec); the plan leaves room for
  // options.plan_group's jobs when it is made from a budget.
  FluxGroupTrainer(const JobSpec& first, const FluxGroupOptions& options);
  ~FluxGroupTrainer() override;
  FluxGroupTrainer(const FluxGroupTrainer&) = delete;
  FluxGroupTrainer& operator=(const FluxGroupTrainer&) = delete;

  // A FLUX job joins at a step boundary, resuming from its output folder's newest checkpoint
  // (options.resume). One that cannot join (GroupRefusal) or start (bad caches, a locked
  // output folder, a checkpoint of other settings) leaves at once with its error (TakeLeft).
  // The outcome's TrainResult: start_step, steps_done, stopped, final_loss, checkpoint_dir,
  // and adapter_dir (its output_dir) once complete.
  size_t Add(GroupJob job) override;
  bool Step() override;
  std::vector<GroupJobOutcome> TakeLeft() override;
  size_t size() const override;
  void Run();  // Step() until every job has left

 private:
  class Job;
  struct Shared;
  std::unique_ptr<Shared> shared_;
  std::unique_ptr<GroupMembers<Job>> members_;
};

// Trains `jobs` as one group until each has finished, stopped or failed; their outcomes in
// the order they were given. The plan leaves room for every job (options.plan_group, unless
// the caller set it).
std::vector<GroupJobOutcome> RunFluxGroupTraining(std::vector<GroupJob> jobs,
                                                  const FluxGroupOptions& options);

// `lorastream-worker plan A.toml B.toml ...` on FLUX jobs: the group's plans (the first job's
// table with every job's memory and measured compute); jobs that cannot share a group are
// refused naming the key.
int RunFluxGroupPlanCommand(const std::vector<std::string>& job_paths, const std::string& device);

}  // namespace lorastream::worker::flux
