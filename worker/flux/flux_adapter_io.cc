#include "worker/flux/flux_adapter_io.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/error.h"
#include "common/safetensors.h"
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
  const SafetensorsFile file = SafetensorsFile::Open(path);
  // Every module a FLUX trainer may adapt, by kohya stem: (block kind, block-relative name).
  std::map<std::string, std::pair<bool, std::string>> known;
  for (int64_t i = 0; i < config.depth; ++i)
    for (const std::string& m : FluxDoubleLinears())
      known[KohyaModuleName("double_blocks." + std::to_string(i) + "." + m)] = {true, m};
  for (int64_t i = 0; i < config.depth_single; ++i)
    for (const std::string& m : FluxSingleLinears())
      known[KohyaModuleName("single_blocks." + std::to_string(i) + "." + m)] = {false, m};
  std::map<std::string, int> parts;  // stem -> tensors seen of its three
  for (const SafetensorsEntry& e : file.tensors()) {
    const std::string& n = e.name;
    std::string stem;
    for (const char* suffix : {".lora_down.weight", ".lora_up.weight", ".alpha"}) {
      const std::string s(suffix);
      if (n.size() > s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0)
        stem = n.substr(0, n.size() - s.size());
    }
    if (stem.empty() || !known.count(stem))
      throw Error(ErrorCode::kUnsupported,
                  path + ": tensor `" + n +
                      "` is not a LoRA weight of a FLUX block linear of this model (kohya names: "
                      "lora_unet_<module>.lora_down.weight / .lora_up.weight / .alpha)");
    ++parts[stem];
  }
  if (parts.empty()) throw Error(ErrorCode::kCorrupt, path + ": holds no LoRA tensor");
  KohyaAdapterInfo info;
  std::set<std::string> doubles, singles;
  std::map<std::string, int> per_module;  // block-relative name -> blocks carrying it
  for (const auto& [stem, count] : parts) {
    if (count != 3)
      throw Error(
          ErrorCode::kCorrupt,
          path + ": `" + stem + "` lacks one of .lora_down.weight, .lora_up.weight, .alpha");
    const SafetensorsEntry* down = file.Find(stem + ".lora_down.weight");
    const SafetensorsEntry* alpha = file.Find(stem + ".alpha");
    if (down->shape.size() != 2)
      throw Error(ErrorCode::kCorrupt, path + ": `" + stem + ".lora_down.weight` is not 2-D");
    if (alpha->dtype != DType::kF32 || alpha->numel() != 1)
      throw Error(ErrorCode::kCorrupt, path + ": `" + stem + ".alpha` is not one f32");
    float a = 0;
    std::memcpy(&a, file.Data(*alpha), sizeof a);
    if (info.rank == 0) {
      info.rank = down->shape[0];
      info.alpha = a;
    } else if (info.rank != down->shape[0] || static_cast<float>(info.alpha) != a) {
      throw Error(ErrorCode::kUnsupported,
                  path + ": `" + stem + "` has rank " + std::to_string(down->shape[0]) +
                      " and alpha " + std::to_string(a) + ", another module rank " +
                      std::to_string(info.rank) + " and alpha " + std::to_string(info.alpha) +
                      " (one rank and alpha per adapter is supported)");
    }
    const auto& [is_double, module] = known.at(stem);
    (is_double ? doubles : singles).insert(module);
    ++per_module[(is_double ? "d:" : "s:") + module];
  }
  for (const auto& [key, blocks] : per_module) {
    const bool is_double = key[0] == 'd';
    if (blocks != (is_double ? config.depth : config.depth_single))
      throw Error(ErrorCode::kUnsupported,
                  path + ": `" + key.substr(2) + "` is adapted in " + std::to_string(blocks) +
                      " of the " + std::to_string(is_double ? config.depth : config.depth_single) +
                      (is_double ? " double" : " single") +
                      " blocks (every block of a kind must carry the same modules)");
  }
  for (const std::string& m : FluxDoubleLinears())
    if (doubles.count(m)) info.targets.push_back(m);
  for (const std::string& m : FluxSingleLinears())
    if (singles.count(m)) info.targets.push_back(m);
  return info;
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
  const KohyaAdapterInfo info = ReadKohyaAdapterInfo(file, config);
  if (job.rank == 0) job.rank = info.rank;
  if (job.alpha == 0) job.alpha = info.alpha;
  if (job.targets.empty()) job.targets = info.targets;
  auto list = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    std::string s;
    for (const std::string& n : v) s += (s.empty() ? "" : ", ") + n;
    return std::pair<std::vector<std::string>, std::string>{v, "[" + s + "]"};
  };
  const auto job_targets = list(FluxTargets(job.targets, "flux.targets"));
  const auto file_targets = list(info.targets);
  const std::string from = " but the file flux.init_from names (" + file + ") has ";
  std::string problems;
  auto add = [&](const std::string& line) { problems += (problems.empty() ? "" : "\n") + line; };
  if (job.rank != info.rank)
    add("flux.rank is " + std::to_string(job.rank) + from + "rank " + std::to_string(info.rank));
  if (static_cast<float>(job.alpha) != static_cast<float>(info.alpha))
    add("flux.alpha is " + std::to_string(job.alpha) + from + "alpha " +
        std::to_string(info.alpha));
  if (job_targets.first != file_targets.first)
    add("flux.targets is " + job_targets.second + from + "targets " + file_targets.second);
  if (!problems.empty()) throw Error(ErrorCode::kRefused, problems);
}

void LoadFluxInitFrom(const FluxJob& job, FluxAdapter& adapter) {
  if (!job.init_from.empty()) LoadKohyaAdapter(KohyaAdapterFile(job.init_from), adapter);
}

}  // namespace lorastream::worker::flux
