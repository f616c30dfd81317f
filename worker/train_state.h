// Checkpoints for resume: OUTPUT_DIR/checkpoint-N/ holding the adapter (peft format, f32
// master weights, so a resume continues from the exact values) and trainer_state.safetensors:
// tensors "exp_avg.<peft key>" and "exp_avg_sq.<peft key>" (f32), metadata "format" =
// "lorastream-trainer-state", "version" = "1", "step", "samples_seen", "seed",
// "fingerprint" (the job settings a resume must not change).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <c10/core/Device.h>

#include "worker/adamw.h"
#include "worker/lora.h"

namespace lorastream {

struct TrainState {
  int64_t step = 0;          // optimizer steps completed
  int64_t samples_seen = 0;  // sequences consumed (the data position)
  uint64_t seed = 0;
  std::string fingerprint;
  double eval_loss = std::numeric_limits<double>::quiet_NaN();  // NaN: no eval at this step
};

// Writes OUTPUT_DIR/checkpoint-<step> (via a temporary folder renamed into place), then
// removes older checkpoint-* folders. Returns the folder.
std::string SaveCheckpoint(const std::string& output_dir, const LoraAdapter& adapter,
                           AdamW& optimizer, const TrainState& state,
                           const std::string& base_model_name_or_path);

// The complete checkpoint with the highest step in output_dir, "" when there is none.
std::string FindLatestCheckpoint(const std::string& output_dir);

// Reads trainer_state.safetensors of `checkpoint_dir` into the optimizer's moments (matched
// by the adapter's key names) and returns the state. Errors name the file and tensor.
TrainState LoadTrainerState(const std::string& checkpoint_dir, const LoraAdapter& adapter,
                            AdamW& optimizer);

}  // namespace lorastream
