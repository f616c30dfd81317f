#include "worker/qwen_image/qwen_image_base.h"

#include <ATen/ATen.h>

#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/formats/qwen_image_layout.h"
#include "worker/model/base_weights.h"

namespace lorastream::worker::qwen_image {

const char* const kQwenImageServeHint =
    "model.store names a store of a Qwen-Image checkpoint: lorastream-store serve "
    "QWEN_IMAGE_PATH";

QwenImageBase QwenImageBase::Load(const std::string& path, c10::ScalarType dtype,
                                  c10::Device device) {
  const QwenImageCheckpointReader source = QwenImageCheckpointReader::Open(path);
  for (const auto& [name, shape] : QwenImageAllShapes(source.config())) {
    const SafetensorsFolder::Ref ref = source.Get(name);
    if (ref.entry->dtype == DType::kF8E4M3)
      RefuseFp8Checkpoint(path, ref.entry->name, "Qwen-Image", "model.store");
  }
  QwenImageBase b;
  b.config_ = source.config();
  b.manifest_ = QwenImageManifest(b.config_, DTypeOf(dtype), Manifest{}.alignment);
  b.manifest_.store_name = "qwen_image";
  b.manifest_.source_dir = path;
  const SourceTensor tensor = [&](const std::string& name) {
    const SafetensorsFolder::Ref ref = source.Get(name);
    return MappedTensor(*ref.file, *ref.entry, name);
  };
  b.unit_buffers_ = PackUnitBuffers(b.manifest_, tensor, "qwen_image");
  b.rest_ = LoadRestTensors(b.manifest_.rest, tensor, device, dtype);
  b.unit_data_ = BufferPointers(b.unit_buffers_);
  b.LogLoaded(path + (source.is_diffusers() ? " (diffusers folder)" : " (single file)"));
  return b;
}

QwenImageBase QwenImageBase::FromStore(const std::string& name, c10::ScalarType dtype,
                                       c10::Device device) {
  AttachedUnits a = AttachUnitStore(name, ModelFamily::kQwenImage, kQwenImageServeHint,
                                    "train.dtype", dtype, device);
  QwenImageBase b;
  b.config_ = a.manifest.qwen_image;
  b.manifest_ = std::move(a.manifest);
  b.unit_data_ = std::move(a.unit_data);
  b.rest_ = std::move(a.rest);
  b.store_ = std::move(a.store);
  b.LogLoaded(a.description);
  return b;
}

void QwenImageBase::LogLoaded(const std::string& from) const {
  const QwenImageConfig& c = config_;
  LS_LOG_INFO("Qwen-Image {}: {} blocks (hidden {}, {} heads, text {}), a block {}", from,
              c.num_layers, c.hidden(), c.num_heads, c.joint_attention_dim,
              FormatBytes(manifest_.blocks.front().nbytes));
}

std::unique_ptr<StreamEngine> QwenImageBase::MakeEngine(int64_t blocks_to_swap, int64_t ring_size,
                                                        c10::Device device,
                                                        const StreamEngineOptions& options) const {
  return MakeEngine(UnitSwapPlan(static_cast<int>(manifest_.blocks.size()), blocks_to_swap,
                                 ring_size, "stream.blocks_to_swap"),
                    device, options);
}

std::unique_ptr<StreamEngine> QwenImageBase::MakeEngine(const ResidencyPlan& plan,
                                                        c10::Device device,
                                                        const StreamEngineOptions& options) const {
  return MakeStreamEngine(manifest_, unit_data_, plan, device, options);
}

}  // namespace lorastream::worker::qwen_image
