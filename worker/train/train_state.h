// Checkpoints for resume: OUTPUT_DIR/checkpoint-N/ holding the adapter (peft format, f32
// master weights, so a resume continues from the exact values), trainer_state.safetensors:
// tensors "exp_avg.<peft key>" and "exp_avg_sq.<peft key>" (f32), metadata as
// common/trainer_state_meta.h describes (step, samples_seen, seed, fingerprint, eval_loss),
// and checkpoint_manifest.json (the checksums of both, written last; common/checkpoint_dir.h
// has the folder's rules: verification on resume, fallback, retention).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <c10/core/Device.h>

#include "worker/model/lora.h"
#include "worker/train/adamw.h"

namespace lorastream::worker {

struct TrainState {
  int64_t step = 0;          // optimizer steps completed
  int64_t samples_seen = 0;  // sequences consumed (the data position)
  uint64_t seed = 0;
  std::string fingerprint;
  double eval_loss = std::numeric_limits<double>::quiet_NaN();  // NaN: no eval at this step
};

// Which checkpoints a save keeps (train.keep_checkpoints, train.keep_best).
struct CheckpointRetention {
  int64_t keep = 2;
  bool keep_best = false;
};

// Writes OUTPUT_DIR/checkpoint-<step>: files and manifest into a temporary folder, each file
// and the folder fsynced, renamed into place, the parent fsynced; then applies `retention`
// (common/checkpoint_dir.h). Leftover temporaries of a crashed save are removed first.
// Returns the folder.
std::string SaveCheckpoint(const std::string& output_dir, const LoraAdapter& adapter,
                           AdamW& optimizer, const TrainState& state,
                           const std::string& base_model_name_or_path,
                           const CheckpointRetention& retention = {});

// The newest checkpoint of output_dir whose checksums verify, "" when there is none at all;
// throws Error(kCorrupt) when there are checkpoints but none verifies
// (FindResumableCheckpoint). Removes leftover temporaries first.
std::string FindLatestCheckpoint(const std::string& output_dir);

// Reads trainer_state.safetensors of `checkpoint_dir` into the optimizer's moments (matched
// by the adapter's key names) and returns the state. Errors name the file and tensor.
TrainState LoadTrainerState(const std::string& checkpoint_dir, const LoraAdapter& adapter,
                            AdamW& optimizer);

}  // namespace lorastream::worker
