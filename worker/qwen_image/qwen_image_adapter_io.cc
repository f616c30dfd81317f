#include "worker/qwen_image/qwen_image_adapter_io.h"

#include <filesystem>

#include <ATen/ATen.h>

#include "common/formats/safetensors.h"
#include "worker/model/dit_adapter_io.h"

namespace lorastream::worker::qwen_image {

std::string ComfyModuleName(const std::string& module) { return "diffusion_model." + module; }

void SaveComfyAdapter(const QwenImageAdapter& adapter, const std::string& path) {
  dit::SaveDownUpAdapter(adapter, ComfyModuleName, path,
                         {{"ss_network_module", "networks.lora_qwen_image"},
                          {"ss_network_dim", std::to_string(adapter.rank())},
                          {"ss_network_alpha", std::to_string(adapter.alpha())},
                          {"ss_base_model_version", "qwen_image"},
                          {"format", "pt"}});
}

void SaveQwenDiffusersAdapter(const QwenImageAdapter& adapter, const std::string& path) {
  dit::TensorWriter w;
  for (const auto& [module, m] : adapter.modules()) {
    w.Add("transformer." + module + ".lora_A.weight", m.a);
    w.Add("transformer." + module + ".lora_B.weight", m.b.detach() * adapter.scale());
  }
  WriteSafetensors(path, w.entries, {{"format", "pt"}});
}

void SaveQwenImageAdapters(const QwenImageAdapter& adapter, const std::string& dir) {
  SaveComfyAdapter(adapter, dir + "/" + kComfyAdapterFile);
  SaveQwenDiffusersAdapter(adapter, dir + "/" + kQwenDiffusersAdapterFile);
}

void LoadComfyAdapter(const std::string& path, QwenImageAdapter& adapter) {
  dit::LoadDownUpAdapter(path, ComfyModuleName, adapter);
}

std::string ComfyAdapterFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return (std::filesystem::path(path) / kComfyAdapterFile).string();
  return path;
}

dit::DownUpAdapterInfo ReadComfyAdapterInfo(const std::string& path,
                                            const QwenImageConfig& config) {
  return dit::ReadDownUpAdapterInfo(
      path,
      {{"", config.num_layers, QwenImageBlockLinears(),
        [](int64_t i, const std::string& m) {
          return ComfyModuleName("transformer_blocks." + std::to_string(i) + "." + m);
        }}},
      "Qwen-Image (ComfyUI names: diffusion_model.transformer_blocks.N.<module>)");
}

}  // namespace lorastream::worker::qwen_image
