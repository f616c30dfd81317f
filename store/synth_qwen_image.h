// `lorastream-synth` for Qwen-Image-shaped checkpoints: a preset with model_type =
// "qwen_image" (configs/models/qwen-image-tiny.toml, qwen-image.toml) written as ComfyUI's
// single file, OUT/qwen_image.safetensors (bare names, or under "diffusion_model." with
// --qwen-image-format comfyui-prefixed), or as a diffusers folder (OUT/transformer/:
// config.json and diffusion_pytorch_model.safetensors); the same values in every form
// (SynthValue of the canonical name), the RoPE axes in the single file's metadata.
#pragma once

#include <string>

#include "common/formats/qwen_image_config.h"
#include "store/synth.h"

namespace lorastream::store {

inline constexpr const char* kSynthQwenImageFile = "qwen_image.safetensors";

bool IsQwenImagePreset(const std::string& path);
// The shape of a preset file; errors name the file and the key.
QwenImageConfig LoadQwenImagePreset(const std::string& path, DType* dtype);
SynthResult RunSynthQwenImage(const SynthOptions& options, const std::string& preset_path);
// Random musubi-tuner-style caches for a demo job into `dir`: three images in two buckets
// (32x32 "cat" and "dog" with captions of 5 and 3 tokens, 48x32 "wide" with 4), of the
// preset's text width; with options.flux_cache_pixels one image of that size whose caption
// has options.flux_text_tokens tokens.
void WriteQwenImageDemoCaches(const SynthOptions& options, const std::string& preset_path,
                              const std::string& dir);

}  // namespace lorastream::store
