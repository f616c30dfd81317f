// Qwen-Image's frozen base for training: read from ComfyUI's single file or a diffusers folder
// (common/formats/qwen_image_layout.h validates either), its blocks packed one per streaming unit
// into host buffers in the layout a store would serve (one contiguous region per unit), converted
// to the compute dtype once, or attached from a store serving it (the units then the store's
// read-only segments); the tensors outside the blocks on the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/manifest.h"
#include "common/formats/qwen_image_config.h"
#include "worker/stream/stream_engine.h"
#include "worker/stream/unit_pack.h"

namespace lorastream::store {
class AttachedStore;
}

namespace lorastream::worker::qwen_image {

// How a Qwen-Image job names its store, for refusals of a store of another family.
extern const char* const kQwenImageServeHint;

class QwenImageBase {
 public:
  // ComfyUI's single file or a diffusers folder; anything else refused by name, and so is an
  // fp8 checkpoint (Error(kUnsupported) naming the tensor: a store serves it, FromStore).
  static QwenImageBase Load(const std::string& path, c10::ScalarType dtype, c10::Device device);
  // The Qwen-Image store `name` (lorastream-store serve QWEN_IMAGE_PATH), attached read-only:
  // its blocks stream from the shared mapping, the tensors outside them are copied to
  // `device` (worker/stream/unit_pack.h AttachUnitStore). Refuses (kRefused) a store of another
  // family naming it, and a plain store of another dtype than `dtype` naming both; a
  // compressed store's (`serve --quantize`) linears are expanded into `dtype` at each use.
  static QwenImageBase FromStore(const std::string& name, c10::ScalarType dtype,
                                 c10::Device device);

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
  void LogLoaded(const std::string& from) const;

  QwenImageConfig config_;
  Manifest manifest_;
  std::vector<at::Tensor> unit_buffers_;               // Load: host bytes, one per unit
  std::shared_ptr<const store::AttachedStore> store_;  // FromStore: the mapping units are in
  std::vector<const uint8_t*> unit_data_;              // unit u's bytes, either way
  dit::NamedTensors rest_;
};

}  // namespace lorastream::worker::qwen_image
