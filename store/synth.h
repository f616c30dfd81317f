// `lorastream-synth`: writes a Hugging Face checkpoint (config.json, sharded .safetensors and
// model.safetensors.index.json) of a preset's architecture with deterministic random
// weights. Element i of tensor T is a function of (seed, T's name, i) alone, so any chunk is
// generated independently (in parallel, at disk speed) and two runs write identical bytes.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/model_config.h"

namespace lorastream::store {

struct Preset {
  ModelConfig config;
  DType dtype = DType::kF32;  // what synth writes by default
};

// `name_or_path`: a preset name (NAME.toml in `presets_dir`) or a path to a .toml file.
// Errors name the file and the key (TomlSection) or the config field.
Preset LoadPreset(const std::string& name_or_path, const std::string& presets_dir);

// $LORASTREAM_PRESETS_DIR, else ConfigsDir()/models (installed, or the source tree's).
std::string DefaultPresetsDir();

struct SynthOptions {
  std::string preset;
  std::string out_dir;
  std::string presets_dir;  // "" -> DefaultPresetsDir()
  int64_t layers = 0;       // > 0 overrides num_hidden_layers
  uint64_t seed = 0;
  std::string dtype;                  // "f32" | "f16" | "bf16"; "" -> the preset's
  uint64_t shard_bytes = 4ull << 30;  // start a new shard past this many bytes
  int threads = 0;                    // generator threads; 0: one per hardware thread
  std::string tokenizer_dir;  // copy this folder's tokenizer files in; vocab_size grows to fit
  bool force = false;  // write into an out_dir that holds files (else Error kInvalidArgument)
};

struct SynthResult {
  uint64_t bytes = 0;
  int shards = 0;
  double seconds = 0;
};

SynthResult RunSynth(const SynthOptions& options);

// The value synth writes at element `index` of tensor `name` (as float, before rounding to
// the file's dtype); `rank` is the tensor's number of dimensions. Exposed for tests.
float SynthValue(const std::string& name, size_t rank, uint64_t seed, uint64_t index);

}  // namespace lorastream::store
