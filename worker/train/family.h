// The family interface: what a model family tells the one trainer (worker/train/group_trainer.h).
//
// The trainer owns everything a job does whatever its model computes: the output folder's
// lock, AdamW, the learning-rate schedule, clipping, the step counter and the data position,
// resume (fingerprint check first, then the adapter and the optimizer's moments), checkpoints
// (worker/train/train_state.h: one writer, one reader), stats.jsonl, on_step, stops and
// failures. A family owns the rest: its base and model on the device (FamilyGroup), and per
// job (FamilyJob) its data and batches, its adapter and its files, the objective, evaluation.
// Nothing outside a family folder branches on the family; a new family implements these two
// classes in its own folder and adds one row to worker/families.cc.
//
// Per group step the trainer calls, in order: FamilyJob::Begin for every job,
// FamilyGroup::RunStep once (every job's forward and backward: the shared work), then per job
// clipping and AdamW over FamilyJob::Params() and FamilyJob::AfterUpdate, and one read of
// every job's figures from the device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

#include "common/job/job_spec.h"
#include "common/job/step_stats.h"
#include "worker/train/trainer.h"

namespace lorastream::worker {

class AdamW;
class StoppableProvider;

// One job's family part: its data, its adapter and its steps' inputs.
class FamilyJob {
 public:
  virtual ~FamilyJob() = default;

  // The job settings a resume must keep (a checkpoint's fingerprint): changing any of them
  // would silently train another job.
  virtual std::string Fingerprint() const = 0;
  // The adapter, fresh from the job's seed (resume_dir "") or a checkpoint's exactly. Called
  // once, after the output folder is locked and the checkpoint's fingerprint was checked,
  // before Params().
  virtual void StartAdapter(const std::string& resume_dir) = 0;
  // The trainable tensors (the optimizer's, in a fixed order) and their names in a
  // checkpoint's trainer_state.safetensors ("exp_avg.<name>", "exp_avg_sq.<name>").
  virtual std::vector<at::Tensor> Params() const = 0;
  virtual std::vector<std::string> ParamNames() const = 0;
  // Writes the adapter's files into `dir` (a checkpoint's temporary folder, or output_dir at
  // the end): FamilyGroup::CheckpointFiles() less the trainer state.
  virtual void SaveAdapter(const std::string& dir) const = 0;
  // The line a finished run ends with (after the job's name): its steps, loss and where its
  // adapter files are, for the consumers that load them.
  virtual std::string DescribeDone(int64_t first_step, int64_t last_step, double loss,
                                   double eval_loss) const = 0;

  // The job file's key of the learning rate (named when a loss diverges).
  virtual std::string learning_rate_key() const { return "optim.lr"; }

  // The job's last step (its steps in all).
  virtual int64_t total_steps() const = 0;
  // Micro-batches per optimizer step (gradient accumulation).
  virtual int64_t micro_batches() const { return 1; }
  // The step that begins at (step, samples_seen): its input, made now unless AfterUpdate made
  // it ahead.
  virtual void Begin(int64_t step, int64_t samples_seen) = 0;
  // What the step begun consumes of the data (samples) and trains on (tokens).
  virtual int64_t step_samples() const = 0;
  virtual int64_t step_tokens() const = 0;
  // After the optimizer's step: the gradients cleared; the next step's input may be made here,
  // while the device still runs this step's tail.
  virtual void AfterUpdate(AdamW& optimizer, int64_t next_step, int64_t next_samples) = 0;
  // Evaluation when due after `step` (every eval.every steps, at every checkpoint, at the end):
  // sets stats->eval_loss and eval_tokens and returns true; false when the job evaluates
  // nothing at this step.
  virtual bool EvaluateIfDue(int64_t step, bool checkpoint_now, StepStats* stats) { return false; }
  // Memory a replayed CUDA graph used when it was captured (a replay allocates nothing), and
  // the micro-batches replayed from graphs so far.
  virtual uint64_t captured_peak_bytes() const { return 0; }
  virtual int64_t graphed_micro_batches() const { return 0; }
};

// A group's family part: the base and the model on the device, and the shared work of a step.
class FamilyGroup {
 public:
  virtual ~FamilyGroup() = default;
  // What its log calls the group ("group", "FLUX group").
  virtual std::string log_name() const = 0;
  // A job of the group (its spec resolved, GroupRefusal already passed): refused (Error)
  // naming what is wrong with it against the model (its data, its settings).
  virtual std::unique_ptr<FamilyJob> MakeJob(const JobSpec& spec) = 0;
  // The files a complete checkpoint of this family holds (its manifest's required list).
  virtual std::vector<std::string> CheckpointFiles() const = 0;
  // The group's provider (stopped between two blocks when every job asks to stop).
  virtual StoppableProvider& provider() = 0;
  // One step's shared work for `jobs` (in the group's order, each begun): every micro-batch's
  // forward and backward, the gradients accumulated into each job's Params(). Returns per job
  // its micro-batches' losses (device scalars; a job with fewer micro-batches has fewer).
  virtual std::vector<std::vector<at::Tensor>> RunStep(const std::vector<FamilyJob*>& jobs) = 0;
  // Why the memory the group was planned for cannot also hold `others` beside the job it was
  // planned for: the jobs of a running group, then one that asks to join it last. The group's
  // estimated peak under its plan with them all, against the plan's limit (its budget, else
  // the device's memory); "" when it fits. A refused job waits for the group to drain.
  virtual std::string JoinRefusal(const std::vector<JobSpec>& others) const = 0;
  // A job joined or is about to leave (what the group keeps of its jobs' tensors is dropped).
  virtual void MembersChanged() {}
  // Before the jobs are destroyed at the group's end.
  virtual void Release() {}
  // As FamilyJob::captured_peak_bytes, for the group's own graphs.
  virtual uint64_t captured_peak_bytes() const { return 0; }
};

// The registry (worker/families.cc: a row per family).
// The name of the family that trains `spec` ("LLM", "FLUX"); Error(kUnsupported) when none does.
std::string FamilyName(const JobSpec& spec);
// The group part of `first`'s family on options.device: its base read, its model built, its
// provider planned for `first` and options.plan_group. The provider asks all_stop before each
// block it hands out (StoppableProvider).
std::unique_ptr<FamilyGroup> MakeFamilyGroup(const JobSpec& first, const TrainOptions& options,
                                             std::function<bool()> all_stop);

}  // namespace lorastream::worker
