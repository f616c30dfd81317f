// A flux-tiny checkpoint (BFL's single-file layout, seed 3) for the FLUX tests, and an fp8
// checkpoint made of one.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/formats/flux_config.h"
#include "common/formats/safetensors.h"
#include "store/quantize.h"
#include "store/synth.h"

namespace lorastream::testing {

// Writes DIR/flux1.safetensors (and its folder) with lorastream-synth's flux-tiny preset in
// `dtype` (f32 | bf16); returns the file. With `format` "diffusers": the same weights as a
// diffusers folder (DIR/transformer/, shards of at most `shard_bytes`); returns DIR.
inline std::string MakeFluxCheckpoint(const std::string& dir, const std::string& dtype = "f32",
                                      const std::string& format = "bfl",
                                      uint64_t shard_bytes = 4ull << 30) {
  store::SynthOptions o;
  o.preset = "flux-tiny";
  o.out_dir = dir;
  o.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  o.seed = 3;
  o.dtype = dtype;
  o.flux_format = format;
  o.shard_bytes = shard_bytes;
  store::RunSynth(o);
  return format == "diffusers" ? dir : dir + "/flux1.safetensors";
}

// The f32 single file at `from` rewritten to `to` with every weight `is_linear` names cast to
// e4m3 (round to nearest), as the fp8 checkpoints users download hold them (flux1-dev-fp8,
// qwen_image_fp8_e4m3fn: no scales); the weight named `keep` stays as it is.
inline void WriteFp8Checkpoint(const std::string& from, const std::string& to,
                               const std::function<bool(const std::string&)>& is_linear,
                               const std::string& keep = "") {
  const SafetensorsFile f = SafetensorsFile::Open(from);
  std::vector<TensorToWrite> tensors;
  std::vector<std::vector<uint8_t>> fp8;
  fp8.reserve(f.tensors().size());
  for (const SafetensorsEntry& e : f.tensors()) {
    tensors.push_back({e.name, e.dtype, e.shape, f.Data(e)});
    if (!is_linear(e.name) || e.name == keep) continue;
    const auto* values = reinterpret_cast<const float*>(f.Data(e));
    fp8.emplace_back(e.numel());
    for (size_t i = 0; i < fp8.back().size(); ++i) fp8.back()[i] = store::FloatToE4M3(values[i]);
    tensors.back().dtype = DType::kF8E4M3;
    tensors.back().data = fp8.back().data();
  }
  WriteSafetensors(to, tensors, f.header().metadata);
}

// The f32 BFL file at `from` as an fp8 FLUX checkpoint (every block linear's weight in e4m3).
inline void WriteFp8FluxCheckpoint(const std::string& from, const std::string& to,
                                   const std::string& keep = "") {
  WriteFp8Checkpoint(from, to, IsFluxBlockLinearWeight, keep);
}

}  // namespace lorastream::testing
