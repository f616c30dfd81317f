#include "worker/flux/flux_adapter_io.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "worker/model/dit_adapter_io.h"

namespace lorastream::worker::flux {

using Writer = dit::TensorWriter;

void SaveKohyaAdapter(const FluxAdapter& adapter, const std::string& path) {
  dit::SaveDownUpAdapter(adapter, KohyaModuleName, path,
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
  dit::LoadDownUpAdapter(path, KohyaModuleName, adapter);
}

std::string KohyaAdapterFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return (std::filesystem::path(path) / "adapter_kohya.safetensors").string();
  return path;
}

KohyaAdapterInfo ReadKohyaAdapterInfo(const std::string& path, const FluxConfig& config) {
  const auto stem = [](const char* kind) {
    return [kind](int64_t i, const std::string& m) {
      return KohyaModuleName(std::string(kind) + std::to_string(i) + "." + m);
    };
  };
  return dit::ReadDownUpAdapterInfo(
      path,
      {{"double", config.depth, FluxDoubleLinears(), stem("double_blocks.")},
       {"single", config.depth_single, FluxSingleLinears(), stem("single_blocks.")}},
      "FLUX (kohya names: lora_unet_<module>)");
}

FluxAdapter ReadKohyaAdapter(const std::string& path, const FluxConfig& config,
                             c10::Device device) {
  const std::string file = KohyaAdapterFile(path);
  const KohyaAdapterInfo info = ReadKohyaAdapterInfo(file, config);
  FluxAdapter adapter(config, info.targets, info.rank, info.alpha, 0, at::kCPU);
  LoadKohyaAdapter(file, adapter);
  if (device != at::kCPU) {
    c10::NoGradGuard no_grad;
    for (auto& [name, m] : adapter.modules()) {
      m.a = m.a.detach().to(device).requires_grad_(true);
      m.b = m.b.detach().to(device).requires_grad_(true);
    }
  }
  return adapter;
}

void ApplyFluxInitFrom(FluxJob& job, const FluxConfig& config) {
  if (job.init_from.empty()) return;
  const std::string file = KohyaAdapterFile(job.init_from);
  const std::string targets_key = FluxKeyName(job, "targets");  // flux.targets or lora.targets
  dit::ApplyDownUpInitFrom(
      ReadKohyaAdapterInfo(file, config), file, targets_key.substr(0, targets_key.find('.') + 1),
      [&targets_key](const std::vector<std::string>& t) { return FluxTargets(t, targets_key); },
      job.rank, job.alpha, job.targets);
}

void LoadFluxInitFrom(const FluxJob& job, FluxAdapter& adapter) {
  if (!job.init_from.empty()) LoadKohyaAdapter(KohyaAdapterFile(job.init_from), adapter);
}

}  // namespace lorastream::worker::flux
