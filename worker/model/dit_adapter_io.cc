#include "worker/model/dit_adapter_io.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/error.h"

namespace lorastream::worker::dit {

void TensorWriter::Add(const std::string& name, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  keep.push_back(c);
  entries.push_back({name, DType::kF32, c.sizes().vec(), c.data_ptr()});
}

void SaveDownUpAdapter(const LoraAdapter& adapter, const ModuleStem& stem, const std::string& path,
                       const std::map<std::string, std::string>& metadata) {
  TensorWriter w;
  for (const auto& [module, m] : adapter.modules()) {
    const std::string s = stem(module);
    w.Add(s + ".lora_down.weight", m.a);
    w.Add(s + ".lora_up.weight", m.b);
    w.Add(s + ".alpha", at::scalar_tensor(adapter.alpha(), at::kFloat));
  }
  WriteSafetensors(path, w.entries, metadata);
}

void LoadDownUpAdapter(const std::string& path, const ModuleStem& stem, LoraAdapter& adapter) {
  const SafetensorsFile file = SafetensorsFile::Open(path);
  auto read = [&](const std::string& name, const at::Tensor& like) {
    const SafetensorsEntry* e = file.Find(name);
    if (e == nullptr) throw Error(ErrorCode::kCorrupt, path + ": no tensor `" + name + "`");
    if (e->dtype != DType::kF32 || e->shape != like.sizes().vec())
      throw Error(ErrorCode::kCorrupt, path + ": tensor `" + name + "` is not f32 of shape " +
                                           ShapeString(like.sizes().vec()));
    return at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape, at::kFloat).clone();
  };
  for (auto& [module, m] : adapter.modules()) {
    const std::string s = stem(module);
    const float alpha = read(s + ".alpha", at::scalar_tensor(0.0f)).item<float>();
    if (alpha != static_cast<float>(adapter.alpha()))
      throw Error(ErrorCode::kCorrupt, path + ": `" + s + ".alpha` is " + std::to_string(alpha) +
                                           ", the job's alpha " + std::to_string(adapter.alpha()));
    c10::NoGradGuard no_grad;
    m.a.copy_(read(s + ".lora_down.weight", m.a));
    m.b.copy_(read(s + ".lora_up.weight", m.b));
  }
}

}  // namespace lorastream::worker::dit
