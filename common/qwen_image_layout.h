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

#include "common/manifest.h"
#include "common/qwen_image_config.h"
#include "common/safetensors.h"

namespace lorastream {

// The manifest of a Qwen-Image of shape `c` packed per block: blocks[u] holds block u's
// tensors under their full names in QwenImageUnitShapes order, `rest` QwenImageRestShapes,
// each laid out by LayoutSegment (a compressed `linears` format: each block linear's weight,
// IsQwenImageBlockLinearWeight, stored in it). model_type kQwenImageModelType,
// num_hidden_layers the block count.
Manifest QwenImageManifest(const QwenImageConfig& c, DType dtype, uint64_t alignment,
                           const QuantInfo& linears = {});

// Whether `m`'s blocks are Qwen-Image units (model_type kQwenImageModelType).
inline bool IsQwenImageManifest(const Manifest& m) {
  return m.config.model_type == kQwenImageModelType;
}

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
