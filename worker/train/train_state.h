// Checkpoints for resume, one writer and one reader for every family: OUTPUT_DIR/checkpoint-N/
// holding the adapter's files (FamilyJob::SaveAdapter: f32 master weights, so a resume
// continues from the exact values), trainer_state.safetensors: tensors "exp_avg.<name>" and
// "exp_avg_sq.<name>" by FamilyJob::ParamNames (f32 of the parameter's shape; with 8-bit
// moments, worker/train/adamw.h, U8 of whole blocks beside "exp_avg_absmax.<name>" and
// "exp_avg_sq_absmax.<name>", f32, one per block), metadata as
// common/formats/trainer_state_meta.h describes (step, samples_seen, seed, fingerprint, eval_loss),
// and checkpoint_manifest.json (the checksums of the family's files, written last;
// common/formats/checkpoint_dir.h has the folder's rules: verification on resume, fallback,
// retention).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/trainer_state_meta.h"
#include "worker/train/adamw.h"
#include "worker/train/family.h"

namespace lorastream::worker {

using TrainState = TrainerStateMeta;

// Which checkpoints a save keeps (train.keep_checkpoints, train.keep_best).
struct CheckpointRetention {
  int64_t keep = 2;
  bool keep_best = false;
};

// Writes OUTPUT_DIR/checkpoint-<state.step>: files and manifest (listing `files`, the
// family's FamilyGroup::CheckpointFiles) into a temporary folder, each file and the folder
// fsynced, renamed into place, the parent fsynced; then applies `retention`
// (common/formats/checkpoint_dir.h). Leftover temporaries of a crashed save are removed first.
// Returns the folder.
std::string SaveCheckpoint(const std::string& output_dir, const FamilyJob& job, AdamW& optimizer,
                           const TrainState& state, const CheckpointRetention& retention,
                           const std::vector<std::string>& files);

// The newest checkpoint of output_dir whose checksums verify, "" when there is none at all;
// throws Error(kCorrupt) when there are checkpoints but none verifies
// (FindResumableCheckpoint). Removes leftover temporaries first.
std::string FindLatestCheckpoint(const std::string& output_dir,
                                 const std::vector<std::string>& files);

// The trainer state's metadata of `checkpoint_dir` (errors name the file and the key).
TrainState ReadTrainerState(const std::string& checkpoint_dir);

// Reads the optimizer's moments (by `names`, the adapter's ParamNames) from
// trainer_state.safetensors of `checkpoint_dir` and sets its step to `step`: exactly as saved
// where the file's kind of moments is the optimizer's, converted (dequantised, or quantised)
// where the job's optim.type changed since. Errors name the file and tensor.
void LoadOptimizerState(const std::string& checkpoint_dir, const std::vector<std::string>& names,
                        int64_t step, AdamW& optimizer);

}  // namespace lorastream::worker
