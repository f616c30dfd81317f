#include "worker/flux/flux_adapter_io.h"

#include <cstring>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/error.h"
#include "common/safetensors.h"

namespace lorastream::worker::flux {

namespace {

struct Writer {
  std::vector<at::Tensor> keep;  // the CPU tensors the entries point into
  std::vector<TensorToWrite> entries;
  void Add(const std::string& name, const at::Tensor& t) {
    at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
    keep.push_back(c);
    entries.push_back({name, DType::kF32, c.sizes().vec(), c.data_ptr()});
  }
};

}  // namespace

void SaveKohyaAdapter(const FluxAdapter& adapter, const std::string& path) {
  Writer w;
  for (const auto& [module, m] : adapter.modules()) {
    const std::string stem = KohyaModuleName(module);
    w.Add(stem + ".lora_down.weight", m.a);
    w.Add(stem + ".lora_up.weight", m.b);
    w.Add(stem + ".alpha", at::scalar_tensor(adapter.alpha(), at::kFloat));
  }
  WriteSafetensors(path, w.entries,
                   {{"ss_network_module", "networks.lora_flux"},
                    {"ss_network_dim", std::to_string(adapter.rank())},
                    {"ss_network_alpha", std::to_string(adapter.alpha())},
                    {"ss_base_model_version", "flux1"},
                    {"format", "pt"}});
}

void SaveDiffusersAdapter(const FluxAdapter& adapter, const FluxConfig& config,
                          const std::string& path) {
  Writer w;
  for (const auto& [module, m] : adapter.modules()) {
    const at::Tensor b = m.b.detach() * adapter.scale();
    for (const auto& part : DiffusersParts(module, config)) {
      w.Add("transformer." + part.name + ".lora_A.weight", m.a);
      w.Add("transformer." + part.name + ".lora_B.weight",
            b.narrow(0, part.row_begin, part.row_end - part.row_begin));
    }
  }
  WriteSafetensors(path, w.entries, {{"format", "pt"}});
}

void LoadKohyaAdapter(const std::string& path, FluxAdapter& adapter) {
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
    const std::string stem = KohyaModuleName(module);
    const float alpha = read(stem + ".alpha", at::scalar_tensor(0.0f)).item<float>();
    if (alpha != static_cast<float>(adapter.alpha()))
      throw Error(ErrorCode::kCorrupt, path + ": `" + stem + ".alpha` is " + std::to_string(alpha) +
                                           ", the job's alpha " + std::to_string(adapter.alpha()));
    c10::NoGradGuard no_grad;
    m.a.copy_(read(stem + ".lora_down.weight", m.a));
    m.b.copy_(read(stem + ".lora_up.weight", m.b));
  }
}

}  // namespace lorastream::worker::flux
