// FLUX.1 packed for streaming, torch-free: the one layout of its streaming units (a store's
// segments and a worker's own host buffers are the same bytes), that layout's record in a
// store's manifest, and a checkpoint's tensors read by BFL name whichever layout holds them
// (BFL's single file, or a diffusers folder whose fused projections are runs of rows of
// several of its tensors: common/formats/flux_diffusers.h).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/formats/flux_config.h"
#include "common/formats/flux_diffusers.h"
#include "common/formats/manifest.h"
#include "common/formats/safetensors.h"

namespace lorastream {

// The single-stream blocks per streaming unit a store packs (FluxUnit: two FLUX.1-dev single
// blocks fill 83% of a slot sized for a double block).
inline constexpr int64_t kFluxDefaultSinglesPerUnit = 2;

// The manifest of a FLUX.1 of shape `c` packed per streaming unit: blocks[u] is unit u of
// FluxUnits(c, singles_per_unit) with its tensors under their full BFL names
// ("double_blocks.0.img_attn.qkv.weight") in FluxUnitShapes order, `rest` the tensors
// outside the blocks (FluxRestShapes), each laid out by LayoutSegment. model_type is
// kFluxModelType and num_hidden_layers the unit count; names, checksums, generation and owner
// are left empty for the packer to fill. With a compressed `linears` format (a `--quantize`
// store) each block linear's weight (IsFluxBlockLinearWeight) is stored in it, followed by its
// scales (LayoutSegment); biases, norms and `rest` stay in `dtype`.
Manifest FluxManifest(const FluxConfig& c, int64_t singles_per_unit, DType dtype,
                      uint64_t alignment, const QuantInfo& linears = {});

// The FLUX part of a manifest's JSON ({shape..., "singles_per_unit": n}) and back: the reader
// sets m.flux, m.flux_singles_per_unit and m.config (model_type, the unit count), validating
// the shape (Error(kCorrupt) naming `source` and the field).
void FluxManifestToJson(nlohmann::json& out, const Manifest& m);
void FluxManifestFromJson(const nlohmann::json& in, Manifest& m, const std::string& source);

// A FLUX.1 checkpoint opened for reading by BFL name (DetectFluxCheckpoint: BFL's single
// file, or a diffusers folder; every tensor checked against the shape).
class FluxCheckpointReader {
 public:
  static FluxCheckpointReader Open(const std::string& path);

  const FluxConfig& config() const { return config_; }
  const std::string& path() const { return path_; }
  bool is_diffusers() const { return diffusers_.has_value(); }

  // A run of rows of BFL tensor `name`: its rows [row, row + rows) are the checkpoint
  // tensor `entry`'s rows [source_row, source_row + rows) in `file`.
  using Piece = SafetensorsRows;
  // The pieces of BFL tensor `name`, in row order (one for every tensor of a BFL file).
  std::vector<Piece> Pieces(const std::string& name) const;

 private:
  std::string path_;
  FluxConfig config_;
  std::optional<SafetensorsFile> file_;
  std::optional<FluxDiffusersFolder> diffusers_;
  std::map<std::string, std::vector<FluxDiffusersPart>> parts_;  // by BFL name, in row order
};

}  // namespace lorastream
