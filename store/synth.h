// `lorastream-synth`: writes a Hugging Face checkpoint (config.json, sharded .safetensors and
// model.safetensors.index.json) of a preset's architecture with deterministic random
// weights. Element i of tensor T is a function of (seed, T's name, i) alone, so any chunk is
// generated independently (in parallel, at disk speed) and two runs write identical bytes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/base/dtype.h"
#include "common/formats/model_config.h"

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
  // "fp8" | "bnb-nf4": then rewrite the checkpoint as a pre-quantised one is published
  // (WritePrequantized); "": plain.
  std::string prequantized;
  bool force = false;  // write into an out_dir that holds files (else Error kInvalidArgument)
  // FLUX presets: "bfl" (OUT/flux1.safetensors) or "diffusers" (OUT/transformer/: config.json
  // and diffusion_pytorch_model shards, FluxTransformer2DModel's names; the same weights).
  std::string flux_format = "bfl";
  // --caches of a FLUX or Qwen-Image preset: one image of this many pixels ("1024x1024",
  // width x height, multiples of 16) instead of the demo's three; and the text tokens of its
  // caption (FLUX: T5's).
  std::string flux_cache_pixels;
  int64_t flux_text_tokens = 8;
  // Qwen-Image presets: "comfyui" (OUT/qwen_image.safetensors, bare names),
  // "comfyui-prefixed" (the same under "diffusion_model.") or "diffusers" (OUT/transformer/).
  std::string qwen_image_format = "comfyui";
};

struct SynthResult {
  uint64_t bytes = 0;
  int shards = 0;
  double seconds = 0;
};

SynthResult RunSynth(const SynthOptions& options);

// SynthOptions::flux_cache_pixels as (width, height); Error(kInvalidArgument) naming
// --flux-cache-size unless WIDTHxHEIGHT in positive multiples of 16.
std::pair<int64_t, int64_t> CacheImagePixels(const std::string& pixels);

// Rewrites the checkpoint in `dir` as a pre-quantised upload stores it, with the store's own
// quantisation (store/quantize.h): "fp8" (quant_method "fp8", weight_block_size [128, 128]:
// F8_E4M3 weights, F32 `weight_scale_inv`) or "bnb-nf4" (quant_method "bitsandbytes", 4-bit
// nf4, double-quantised: U8 [n/2, 1] weights, absmax, quant_map, nested_absmax,
// nested_quant_map and quant_state.bitsandbytes__nf4). Only the blocks' projection weights
// change; the result is one model.safetensors (the whole model passes through memory: meant
// for test models).
void WritePrequantized(const std::string& dir, const std::string& format);

// The value synth writes at element `index` of tensor `name` (as float, before rounding to
// the file's dtype); `rank` is the tensor's number of dimensions. Exposed for tests.
float SynthValue(const std::string& name, size_t rank, uint64_t seed, uint64_t index);
// Elements [first, first + count) of tensor `name` (SynthValue's) in `dtype` into `out`, on
// `threads` threads when the run is long.
void SynthFill(const std::string& name, size_t rank, uint64_t seed, uint64_t first, uint64_t count,
               DType dtype, uint8_t* out, int threads);

}  // namespace lorastream::store
