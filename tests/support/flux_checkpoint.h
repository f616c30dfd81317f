// A flux-tiny checkpoint (BFL's single-file layout, seed 3) for the FLUX tests.
#pragma once

#include <string>

#include "store/synth.h"

namespace lorastream::testing {

// Writes DIR/flux1.safetensors (and its folder) with lorastream-synth's flux-tiny preset in
// `dtype` (f32 | bf16); returns the file.
inline std::string MakeFluxCheckpoint(const std::string& dir, const std::string& dtype = "f32") {
  store::SynthOptions o;
  o.preset = "flux-tiny";
  o.out_dir = dir;
  o.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  o.seed = 3;
  o.dtype = dtype;
  store::RunSynth(o);
  return dir + "/flux1.safetensors";
}

}  // namespace lorastream::testing
