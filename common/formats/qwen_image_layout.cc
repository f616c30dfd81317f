#include "common/formats/qwen_image_layout.h"

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/posix/regular_file.h"

namespace lorastream {

Manifest QwenImageManifest(const QwenImageConfig& c, DType dtype, uint64_t alignment,
                           const QuantInfo& linears) {
  Manifest m;
  m.config.model_type = kQwenImageModelType;
  m.qwen_image = c;
  m.dtype = dtype;
  m.alignment = alignment;
  for (int64_t i = 0; i < c.num_layers; ++i)
    m.blocks.push_back(LayoutSegment(QwenImageUnitShapes(c, i), "", dtype, alignment, linears));
  m.rest = LayoutSegment(QwenImageRestShapes(c), "", dtype, alignment);
  m.config.num_hidden_layers = c.num_layers;
  return m;
}

void QwenImageManifestFromJson(const nlohmann::json& in, Manifest& m, const std::string& source) {
  if (!in.is_object())
    throw Error(ErrorCode::kCorrupt, source + ": manifest `qwen_image` must be an object");
  m.qwen_image = QwenImageConfigFromJson(in.dump(), source + " (qwen_image)");
  m.config = ModelConfig{};
  m.config.model_type = kQwenImageModelType;
  m.config.num_hidden_layers = m.qwen_image.num_layers;
}

QwenImageCheckpointReader QwenImageCheckpointReader::Open(const std::string& path) {
  QwenImageCheckpointReader r;
  r.path_ = path;
  if (DetectQwenImageCheckpoint(path) == QwenImageCheckpointKind::kSingleFile) {
    r.file_.emplace(SafetensorsFile::Open(path));
    r.prefix_ = QwenImageKeyPrefix(r.file_->header(), path);
    r.config_ = QwenImageConfigFromHeader(r.file_->header(), r.prefix_, path);
    return r;
  }
  std::string dir = path;
  struct stat st {};
  if (::stat((dir + "/transformer/config.json").c_str(), &st) == 0) dir += "/transformer";
  const std::string config_path = dir + "/config.json";
  r.config_ = QwenImageConfigFromJson(
      ReadRegularFile(config_path, kMaxTextFileBytes, "config.json"), config_path);
  r.folder_.emplace(SafetensorsFolder::Open(dir, "diffusion_pytorch_model"));
  TensorShapes have;
  for (const SafetensorsFolder::Ref& ref : r.folder_->AllTensors())
    have.push_back({ref.entry->name, ref.entry->shape});
  RequireExactTensors(have, QwenImageAllShapes(r.config_), dir, "Qwen-Image's transformer");
  return r;
}

SafetensorsFolder::Ref QwenImageCheckpointReader::Get(const std::string& name) const {
  if (folder_) return folder_->Get(name);
  const SafetensorsEntry* e = file_->Find(prefix_ + name);
  LS_CHECK(e != nullptr, "validated Qwen-Image file lacks " + prefix_ + name);
  return {&*file_, e};
}

}  // namespace lorastream
