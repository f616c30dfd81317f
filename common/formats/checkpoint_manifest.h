// The manifest of a training checkpoint (OUTPUT_DIR/checkpoint-N/checkpoint_manifest.json):
// the size and SHA-256 of every file of the folder, written last, after the files are
// complete. A resume verifies it before trusting anything in the folder, so a flipped bit, a
// truncated or deleted file, or an edited trainer state is detected, never trained on.
// Torch-free (the parser is fuzzed: fuzz/fuzz_checkpoint.cc).
//
//   {"format": "lorastream-checkpoint-manifest", "version": 1,
//    "files": [{"name": "adapter_model.safetensors", "bytes": 1234, "sha256": "<64 hex>"}, ...]}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream {

constexpr const char* kCheckpointManifestFile = "checkpoint_manifest.json";

struct CheckpointFileDigest {
  std::string name;  // a plain file name inside the checkpoint folder
  uint64_t bytes = 0;
  std::string sha256;  // 64 lowercase hex characters
};

struct CheckpointManifest {
  std::vector<CheckpointFileDigest> files;
};

std::string CheckpointManifestJson(const CheckpointManifest& manifest);

// Throws Error(kCorrupt) naming `source` and the entry at fault for anything but a
// well-formed manifest: names must be plain, unique file names; digests 64 hex characters.
CheckpointManifest ParseCheckpointManifest(const std::string& text, const std::string& source);

// Hashes every regular file of `dir` (but the manifest), writes the manifest into `dir`, then
// fsyncs every file and `dir` itself. Call it last, when the folder is otherwise complete.
void WriteCheckpointManifest(const std::string& dir);

// Reads and parses the manifest of `dir`, which must list each of `required` (no checksums
// are computed). Throws Error(kCorrupt) naming the manifest when it is missing or malformed.
CheckpointManifest ReadCheckpointManifest(const std::string& dir,
                                          const std::vector<std::string>& required);

// Reads the manifest of `dir` and checks every listed file (size, SHA-256) and that each of
// `required` is listed. Throws Error(kCorrupt) naming the file at fault.
void VerifyCheckpointFiles(const std::string& dir, const std::vector<std::string>& required);

}  // namespace lorastream
