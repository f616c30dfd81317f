// `lorastream-synth` for FLUX.1-shaped checkpoints: a preset with model_type = "flux"
// (configs/models/flux-tiny.toml, flux1-dev.toml) is written as BFL's single file,
// OUT/flux1.safetensors, or (flux_format "diffusers") as a diffusers folder, OUT/transformer/
// (common/formats/flux_diffusers.h), with the same deterministic values as every synth checkpoint
// (SynthValue) and the RoPE axes in its metadata (common/formats/flux_config.h).
#pragma once

#include <map>
#include <string>

#include "common/formats/flux_config.h"
#include "store/synth.h"

namespace lorastream::store {

// The file a FLUX preset is written to in BFL's layout (OUT/flux1.safetensors).
inline constexpr const char* kSynthFluxFile = "flux1.safetensors";

// The preset file a name or path refers to (NAME.toml in `presets_dir`, or the path itself).
std::string PresetPath(const std::string& name_or_path, const std::string& presets_dir);
// Whether the preset file says model_type = "flux".
bool IsFluxPreset(const std::string& path);
// The FLUX shape of a preset file; errors name the file and the key.
FluxConfig LoadFluxPreset(const std::string& path, DType* dtype);
// A safetensors file of `shapes` (each named `prefix` + its name, its values SynthFill's of
// the name without the prefix) in `dtype`; returns the data bytes.
uint64_t WriteSynthFile(const std::string& path, const TensorShapes& shapes,
                        const std::string& prefix, DType dtype, const SynthOptions& options,
                        const std::map<std::string, std::string>& metadata);
SynthResult RunSynthFlux(const SynthOptions& options, const std::string& preset_path);
// Three images' caches (common/formats/flux_cache.h) for the FLUX preset of `options`: two of 32x32
// pixels and one of 48x32 (two buckets), random latents and text features of its widths.
void WriteFluxDemoCaches(const SynthOptions& options, const std::string& dir);

}  // namespace lorastream::store
