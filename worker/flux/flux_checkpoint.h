// A FLUX job's checkpoints for resume: OUTPUT_DIR/checkpoint-N/ holding both adapters
// (adapter_kohya.safetensors: the f32 master weights, unscaled, which a resume reads back
// exactly; pytorch_lora_weights.safetensors for diffusers), trainer_state.safetensors (AdamW's
// moments "exp_avg.<kohya key>" and "exp_avg_sq.<kohya key>" in f32, and the metadata of
// common/trainer_state_meta.h: step, seed, fingerprint) and checkpoint_manifest.json, written
// durably as an LLM job's are (common/checkpoint_dir.h: a temporary folder, fsynced, renamed;
// a damaged checkpoint is detected and the one before it used).
//
// A step's batch, noise and timesteps are functions of the job's seed and the step number
// (worker/flux/flux_train.h), so the step is the whole RNG position: a run resumed from
// checkpoint-N continues exactly as the uninterrupted run did after step N.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/flux_config.h"
#include "common/flux_job.h"
#include "common/trainer_state_meta.h"
#include "worker/flux/flux_model.h"
#include "worker/train/adamw.h"

namespace lorastream::worker::flux {

inline constexpr const char* kKohyaAdapterFile = "adapter_kohya.safetensors";
inline constexpr const char* kDiffusersAdapterFile = "pytorch_lora_weights.safetensors";

// The files a complete FLUX checkpoint holds (each listed in its manifest).
const std::vector<std::string>& FluxCheckpointFiles();

// The job settings a resume must not change (the adapter's shape, the data and the draws).
std::string FluxJobFingerprint(const FluxJob& job);

// Writes both adapters into `dir` (an existing folder).
void SaveFluxAdapters(const FluxAdapter& adapter, const FluxConfig& config, const std::string& dir);

// Publishes checkpoint-<meta.step> in output_dir; keeps the newest `keep` checkpoints.
std::string SaveFluxCheckpoint(const std::string& output_dir, const FluxAdapter& adapter,
                               const FluxConfig& config, AdamW& optimizer,
                               const TrainerStateMeta& meta, int64_t keep);

// The newest checkpoint of output_dir that verifies; "" when it has none (or does not exist).
// Error(kCorrupt) when checkpoints exist but none verifies.
std::string FindFluxCheckpoint(const std::string& output_dir);

// Reads a checkpoint into the adapter and the optimizer (moments and step). Refuses
// (kRefused) one written by a job of another fingerprint, naming both; errors name the file
// and the tensor.
TrainerStateMeta LoadFluxCheckpoint(const std::string& dir, const std::string& fingerprint,
                                    FluxAdapter& adapter, AdamW& optimizer);

}  // namespace lorastream::worker::flux
