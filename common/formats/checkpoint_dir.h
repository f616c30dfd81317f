// The checkpoints of one job's output folder: OUTPUT_DIR/checkpoint-N/ (the adapter, the
// trainer state and a checkpoint_manifest.json of checksums, written last), published by
// renaming a temporary .checkpoint-N.tmp/. Torch-free: the worker saves and resumes through
// it, the coordinator names the best checkpoint from it.
//
// Retention (job keys train.keep_checkpoints, train.keep_best): after each save the newest
// `keep` complete checkpoints stay, plus, with keep_best, the one with the lowest eval loss;
// every other checkpoint-N/ is removed. With keep_best, OUTPUT_DIR/best/ also holds a copy of
// the best checkpoint's adapter files (all but its trainer state and manifest) and best.json
// naming it ({"checkpoint", "step", "eval_loss"}): a stable path for the adapter a user wants,
// replaced when another checkpoint becomes the best. A resume takes the newest checkpoint whose
// files match their checksums; a damaged one is logged (naming the file) and the one before it is
// used; when checkpoints exist but none is usable the resume fails instead of restarting.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/formats/trainer_state_meta.h"

namespace lorastream {

constexpr const char* kTrainerStateFile = "trainer_state.safetensors";

// The files a complete checkpoint of an LLM job must hold (each listed in its manifest). The
// functions below take another list for another family (a FLUX job's: its adapters and
// trainer state, worker/flux/flux_checkpoint.h).
const std::vector<std::string>& CheckpointRequiredFiles();

// "checkpoint-<step>"; CheckpointStepOf is its inverse (-1 for any other name).
std::string CheckpointFolderName(int64_t step);
int64_t CheckpointStepOf(const std::string& name);

struct CheckpointEntry {
  int64_t step = 0;
  std::string dir;
};

// checkpoint-N folders of output_dir, newest first (complete or not).
std::vector<CheckpointEntry> ListCheckpoints(const std::string& output_dir);

// Removes .checkpoint-N.tmp folders that a crash left behind, logging each.
void RemoveStaleCheckpointTemporaries(const std::string& output_dir);

// Verifies the manifest's checksums and parses the trainer state's metadata (whose step
// must match the folder's name). Throws Error(kCorrupt) naming the file at fault.
TrainerStateMeta VerifyCheckpoint(
    const CheckpointEntry& checkpoint,
    const std::vector<std::string>& required = CheckpointRequiredFiles());

// The newest checkpoint that verifies ("" when output_dir holds no checkpoint-N at all).
// Each damaged newer one is logged with its reason. Throws Error(kCorrupt), listing every
// checkpoint and its fault, when checkpoints exist but none verifies.
std::string FindResumableCheckpoint(
    const std::string& output_dir,
    const std::vector<std::string>& required = CheckpointRequiredFiles());

// The complete checkpoint with the lowest finite eval loss ("" when none has one). Reads
// only the manifests and the trainer states' headers (no checksums).
std::string FindBestCheckpoint(const std::string& output_dir);

constexpr const char* kBestAdapterFolder = "best";
constexpr const char* kBestAdapterNote = "best.json";

// OUTPUT_DIR/best when it holds a best adapter (best.json), else "".
std::string BestAdapterDir(const std::string& output_dir);

// Applies the retention rule above (keep >= 1) after checkpoint-<current_step> was saved.
// Complete here means: its manifest parses and lists every required file (no checksums are
// computed). Checkpoints past current_step belong to an abandoned run (a --no-resume start
// over an old folder, or a resume that fell back past a damaged checkpoint) and are removed.
void PruneCheckpoints(const std::string& output_dir, int64_t current_step, int64_t keep,
                      bool keep_best,
                      const std::vector<std::string>& required = CheckpointRequiredFiles());

// Publishes output_dir/checkpoint-<step> durably: leftover temporaries removed, `write_files`
// fills a fresh temporary .checkpoint-<step>.tmp/ (given its path), the manifest is written
// last (every file and the folder fsynced), the folder renamed into place and output_dir
// fsynced; then PruneCheckpoints with `keep`, `keep_best` and `required`. Returns the folder.
std::string PublishCheckpoint(const std::string& output_dir, int64_t step,
                              const std::function<void(const std::string& tmp_dir)>& write_files,
                              int64_t keep, bool keep_best,
                              const std::vector<std::string>& required = CheckpointRequiredFiles());

}  // namespace lorastream
