// Qwen-Image packed for streaming, torch-free: the layout of its streaming units (one
// transformer block each, one contiguous segment; a worker's own host buffers and, later, a
// store's segments are the same bytes), and a checkpoint's tensors read by their canonical
// (diffusers) names whichever form holds them: ComfyUI's single file (bare names or under
// "diffusion_model." / "model.diffusion_model.") or a diffusers folder (transformer/
// config.json and diffusion_pytorch_model*.safetensors).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "common/formats/manifest.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/safetensors.h"

namespace lorastream {

// The manifest of a Qwen-Image of shape `c` packed per block: blocks[u] holds block u's
// tensors under their full names in QwenImageUnitShapes order, `rest` QwenImageRestShapes,
// each laid out by LayoutSegment (a compressed `linears` format: each block linear's weight,
// IsQwenImageBlockLinearWeight, stored in it). model_type kQwenImageModelType,
// num_hidden_layers the block count, `qwen_image` the shape (Manifest::is_qwen_image()).
Manifest QwenImageManifest(const QwenImageConfig& c, DType dtype, uint64_t alignment,
                           const QuantInfo& linears = {});

// The Qwen-Image part of a manifest's JSON (its diffusers config.json, QwenImageConfigJson)
// read back: sets m.qwen_image and m.config (model_type, the block count), validating the
// shape (errors name `source` and the key).
void QwenImageManifestFromJson(const nlohmann::json& in, Manifest& m, const std::string& source);

class QwenImageCheckpointReader {
 public:
  // DetectQwenImageCheckpoint's forms; every tensor checked against the shape (missing,
  // extra or misshapen refused by name).
  static QwenImageCheckpointReader Open(const std::string& path);

  const QwenImageConfig& config() const { return config_; }
  const std::string& path() const { return path_; }
  bool is_diffusers() const { return folder_.has_value(); }
  // The file and entry of canonical tensor `name` (validated).
  SafetensorsFolder::Ref Get(const std::string& name) const;

 private:
  std::string path_;
  QwenImageConfig config_;
  std::string prefix_;
  std::optional<SafetensorsFile> file_;
  std::optional<SafetensorsFolder> folder_;
};

}  // namespace lorastream
