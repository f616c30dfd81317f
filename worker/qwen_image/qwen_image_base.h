// Qwen-Image's frozen base for training: read from ComfyUI's single file or a diffusers folder
// (common/qwen_image_layout.h validates either), its blocks packed one per streaming unit into
// host buffers in the layout a store would serve (one contiguous region per unit), converted
// to the compute dtype once; the tensors outside the blocks on the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/manifest.h"
#include "common/qwen_image_config.h"
#include "worker/model/unit_pack.h"
#include "worker/stream/stream_engine.h"

namespace lorastream::worker::qwen_image {

class QwenImageBase {
 public:
  // ComfyUI's single file or a diffusers folder; anything else refused by name, and so is an
  // fp8 checkpoint (Error(kUnsupported) naming the tensor: not read yet).
  static QwenImageBase Load(const std::string& path, c10::ScalarType dtype, c10::Device device);

  const QwenImageConfig& config() const { return config_; }
  // Block u's packed layout (full tensor names), one contiguous segment per unit.
  const std::vector<SegmentInfo>& layouts() const { return manifest_.blocks; }
  // What the streaming engine is given (model_type qwen_image: tensors served by name).
  const Manifest& engine_manifest() const { return manifest_; }
  const std::vector<const uint8_t*>& unit_bytes() const { return unit_data_; }
  const dit::NamedTensors& rest() const { return rest_; }

  // The engine over the blocks: `blocks_to_swap` streamed through `ring_size` slots, the
  // others resident (0: fully resident); or as `plan` says.
  std::unique_ptr<StreamEngine> MakeEngine(int64_t blocks_to_swap, int64_t ring_size,
                                           c10::Device device,
                                           const StreamEngineOptions& options = {}) const;
  std::unique_ptr<StreamEngine> MakeEngine(const ResidencyPlan& plan, c10::Device device,
                                           const StreamEngineOptions& options = {}) const;

 private:
  QwenImageConfig config_;
  Manifest manifest_;
  std::vector<at::Tensor> unit_buffers_;
  std::vector<const uint8_t*> unit_data_;
  dit::NamedTensors rest_;
};

}  // namespace lorastream::worker::qwen_image
