// What a FLUX job's checkpoints hold (the one writer, worker/train/train_state.h, writes them):
// OUTPUT_DIR/checkpoint-N/ with both adapters (adapter_kohya.safetensors: the f32 master
// weights, unscaled, which a resume reads back exactly; pytorch_lora_weights.safetensors for
// diffusers), trainer_state.safetensors (AdamW's moments "exp_avg.<kohya key>" and
// "exp_avg_sq.<kohya key>" in f32, and the metadata of common/formats/trainer_state_meta.h) and
// checkpoint_manifest.json.
//
// A step's batch, noise and timesteps are functions of the job's seed and the step number
// (worker/flux/flux_train.h), so the step is the whole RNG position: a run resumed from
// checkpoint-N continues exactly as the uninterrupted run did after step N.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/flux_config.h"
#include "common/job/flux_job.h"
#include "worker/flux/flux_model.h"

namespace lorastream::worker::flux {

inline constexpr const char* kKohyaAdapterFile = "adapter_kohya.safetensors";
inline constexpr const char* kDiffusersAdapterFile = "pytorch_lora_weights.safetensors";

// The files a complete FLUX checkpoint holds (each listed in its manifest).
const std::vector<std::string>& FluxCheckpointFiles();

// The job settings a resume must not change (the adapter's shape, the data and the draws).
std::string FluxJobFingerprint(const FluxJob& job);

// Writes both adapters into `dir` (an existing folder).
void SaveFluxAdapters(const FluxAdapter& adapter, const FluxConfig& config, const std::string& dir);

// The optimizer's parameter names, in adapter.Params() order: the kohya names of each module's
// A and B (a checkpoint's "exp_avg.<name>" keys).
std::vector<std::string> FluxParamNames(const FluxAdapter& adapter);

}  // namespace lorastream::worker::flux
