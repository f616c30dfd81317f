// The training loop of one job, as a library call (the standalone `lorastream-worker train`
// and the coordinator's worker loop both call RunTraining). Torch-free header.
//
// Per optimizer step: grad_accum micro-batches of batch_size sequences, each a checkpointed
// forward (blocks 0..L-1) and backward (L-1..0) through the BlockProvider; the loss is the
// mean cross-entropy over every target token of the step (sum / count, as transformers with
// num_items_in_batch); then global grad-norm clipping, AdamW at the scheduled learning rate.
//
// Output folder (train.output_dir):
//   adapter_model.safetensors, adapter_config.json  the final adapter (peft format)
//   checkpoint-N/                                  the newest train.keep_checkpoints
//                                                  checkpoints (and the best with keep_best):
//                                                  the adapter as above plus
//                                                  trainer_state.safetensors (AdamW moments
//                                                  "exp_avg.<key>" / "exp_avg_sq.<key>",
//                                                  metadata: step, samples_seen, seed, job
//                                                  fingerprint, eval_loss) and
//                                                  checkpoint_manifest.json (checksums)
//   stats.jsonl                                    one StepStats JSON object per step
// A checkpoint is written to a temporary folder, fsynced and renamed, then the ones retention
// does not keep are removed; a resume verifies the checksums (common/formats/checkpoint_dir.h).
// Randomness is counter-based: LoRA init from the seed, data order from (seed, epoch),
// dropout masks from (seed, step, micro-batch, block); so step + samples_seen are the whole
// RNG state, and a resumed CPU run ends bit-identical to an uninterrupted one.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/job/job_spec.h"
#include "common/job/step_stats.h"
#include "common/posix/user_access.h"
#include "worker/stream/stream_engine_options.h"
#include "worker/train/step_profile.h"

namespace lorastream::worker {

class BaseWeights;
class BlockProvider;

// Makes the job's BlockProvider (the streaming engine plugs in here). device: "cpu",
// "cuda:N"; dtype: "f32" | "bf16" (the compute dtype); group: the other jobs of a group whose
// memory the plan leaves room for (TrainOptions::plan_group; empty: the job alone). The
// default (an empty function) is the fully resident provider.
using ProviderFactory = std::function<std::unique_ptr<BlockProvider>(
    const JobSpec& spec, const BaseWeights& base, const std::string& device,
    const std::string& dtype, const std::vector<JobSpec>& group)>;

struct TrainOptions {
  std::string device = "cpu";  // "cpu" | "cuda" | "cuda:N"
  bool resume = true;          // continue from output_dir's latest checkpoint when it has one
  int threads = 0;             // intra-op CPU threads; 0 = every core
  ProviderFactory make_provider;
  // A group's jobs besides the first, known when it forms (`train A.toml B.toml`; a serving
  // worker's other slots): the plan (stream.gpu_memory_budget, "auto") leaves room for their
  // activations, tapes, adapters and optimizer states, and refuses a group that cannot fit.
  std::vector<JobSpec> plan_group;
  // Who OUTPUT_DIR/.lorastream.lock says holds the folder while this job trains (a second job
  // into it is refused naming this; a later attempt of the same job takes it over, and this
  // one then stops at its next step: common/job/job_access.h); "": "lorastream-worker pid N".
  std::string lock_holder;
  // A root worker running another user's job: the job's files (its data and eval data, a
  // model folder, the output folder with its checkpoints, adapter and statistics) are opened
  // and created as this user (common/posix/acting_as.h). nullptr: as this process.
  const UserIdentity* files_as = nullptr;
  // A compressed LM head's vocabulary slice when it stays resident (rows; 0: HeadSliceRows's):
  // tests use small ones (a streamed head's is StreamEngineOptions::head_slice_rows).
  int64_t head_slice_rows = 0;
  // The engine of a family that builds its own from its plan (FLUX.1): debug options for tests.
  StreamEngineOptions engine;
  // Tests: the job of this name fails inside every forward and backward it takes part in, as
  // an allocation failure would (the group's split and retry, worker/train/group_trainer.h).
  std::string debug_fail_job;
  // `train --profile`: a window of group steps recorded by LibTorch's profiler
  // (worker/train/step_profile.h); path "" = none.
  StepProfileOptions profile;
};

struct TrainResult {
  int64_t start_step = 0;  // the step it resumed from (0 = fresh)
  int64_t steps_done = 0;  // the last completed step (== spec.train.steps when finished)
  bool stopped = false;    // should_stop() ended it early (after a checkpoint)
  double final_loss = 0.0;
  double final_eval_loss = std::numeric_limits<double>::quiet_NaN();  // the last evaluation
  std::string adapter_dir;     // where the final adapter is (output_dir), when finished
  std::string checkpoint_dir;  // the last checkpoint written
  // Micro-batches replayed from a CUDA graph (worker/train/micro_batch_runner.h); 0 on the CPU.
  int64_t graphed_micro_batches = 0;
  // The line the run ends with once finished (FamilyJob::DescribeDone): steps, loss and the
  // adapter's files.
  std::string done_line;
};

// With an eval set ([eval]) the adapter is evaluated (worker/train/evaluate.h) after every
// eval.every-th step, after every checkpoint step and after the last step; the loss lands in
// that step's StepStats and in TrainState.eval_loss of its checkpoint.
//
// Runs (or resumes) the job to the end. Refusals (Error kRefused, naming the field) happen
// before the first step: invalid spec, model missing, data missing or out of vocabulary,
// sequence longer than the model allows. on_step is called after every step; should_stop is
// polled before every step and before every block a step acquires (so a stop asked inside a
// long step ends it within a block): when it returns true the loop saves a checkpoint of the
// last completed step and returns.
TrainResult RunTraining(const JobSpec& spec, const TrainOptions& options,
                        const std::function<void(const StepStats&)>& on_step = {},
                        const std::function<bool()>& should_stop = {});

// `lorastream-worker train JOB.toml`: loads the job file, prints a progress line per step
// (step/total, loss, lr, grad norm, tokens/s, ETA) to stdout and returns the exit status.
// When *stop_signal becomes non-zero (a SIGTERM/SIGINT handler stores the signal number) the
// run saves a checkpoint at the next step boundary and returns 128 + that number (130 for
// SIGINT, 143 for SIGTERM), as a shell reports a process ended by the signal.
int RunTrainCommand(const std::string& job_path, const TrainOptions& options,
                    const std::atomic<int>* stop_signal = nullptr);

// One progress line, e.g. "step 12/100 loss 2.3456 lr 2.00e-04 gnorm 0.812 tok/s 15321 eta 1m04s".
std::string FormatProgress(const StepStats& stats, double eta_seconds);

}  // namespace lorastream::worker
