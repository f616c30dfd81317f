#include "worker/model/dit_adapter_io.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"

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

DownUpAdapterInfo ReadDownUpAdapterInfo(const std::string& path,
                                        const std::vector<BlockKind>& kinds,
                                        const std::string& family) {
  const SafetensorsFile file = SafetensorsFile::Open(path);
  // Every module a trainer may adapt, by stem: (kind, block-relative name).
  std::map<std::string, std::pair<size_t, std::string>> known;
  for (size_t k = 0; k < kinds.size(); ++k)
    for (int64_t i = 0; i < kinds[k].blocks; ++i)
      for (const std::string& m : kinds[k].linears) known[kinds[k].stem(i, m)] = {k, m};
  std::map<std::string, int> parts;  // stem -> tensors seen of its three
  for (const SafetensorsEntry& e : file.tensors()) {
    const std::string& n = e.name;
    std::string stem;
    for (const char* suffix : {".lora_down.weight", ".lora_up.weight", ".alpha"}) {
      const std::string sfx(suffix);
      if (n.size() > sfx.size() && n.compare(n.size() - sfx.size(), sfx.size(), sfx) == 0)
        stem = n.substr(0, n.size() - sfx.size());
    }
    if (stem.empty() || !known.count(stem))
      throw Error(ErrorCode::kUnsupported,
                  path + ": tensor `" + n + "` is not a LoRA weight of a " + family +
                      " block linear of this model (STEM.lora_down.weight / .lora_up.weight / "
                      ".alpha)");
    ++parts[stem];
  }
  if (parts.empty()) throw Error(ErrorCode::kCorrupt, path + ": holds no LoRA tensor");
  DownUpAdapterInfo info;
  std::vector<std::map<std::string, int64_t>> per_module(kinds.size());  // name -> blocks
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
    const auto& [kind, module] = known.at(stem);
    ++per_module[kind][module];
  }
  for (size_t k = 0; k < kinds.size(); ++k) {
    const BlockKind& kind = kinds[k];
    const std::string blocks = kind.what.empty() ? " blocks" : " " + kind.what + " blocks";
    for (const auto& [module, count] : per_module[k])
      if (count != kind.blocks)
        throw Error(ErrorCode::kUnsupported,
                    path + ": `" + module + "` is adapted in " + std::to_string(count) +
                        " of the " + std::to_string(kind.blocks) + blocks +
                        " (every block of a kind must carry the same modules)");
    for (const std::string& m : kind.linears)
      if (per_module[k].count(m)) info.targets.push_back(m);
  }
  return info;
}

void ApplyDownUpInitFrom(
    const DownUpAdapterInfo& info, const std::string& file, const std::string& prefix,
    const std::function<std::vector<std::string>(const std::vector<std::string>&)>& resolve,
    int64_t& rank, double& alpha, std::vector<std::string>& targets) {
  if (rank == 0) rank = info.rank;
  if (alpha == 0) alpha = info.alpha;
  if (targets.empty()) targets = info.targets;
  auto list = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    std::string s;
    for (const std::string& n : v) s += (s.empty() ? "" : ", ") + n;
    return std::pair<std::vector<std::string>, std::string>{v, "[" + s + "]"};
  };
  const auto job_targets = list(resolve(targets));
  const auto file_targets = list(info.targets);
  const std::string from = " but the file " + prefix + "init_from names (" + file + ") has ";
  std::string problems;
  auto add = [&](const std::string& line) { problems += (problems.empty() ? "" : "\n") + line; };
  if (rank != info.rank)
    add(prefix + "rank is " + std::to_string(rank) + from + "rank " + std::to_string(info.rank));
  if (static_cast<float>(alpha) != static_cast<float>(info.alpha))
    add(prefix + "alpha is " + std::to_string(alpha) + from + "alpha " +
        std::to_string(info.alpha));
  if (job_targets.first != file_targets.first)
    add(prefix + "targets is " + job_targets.second + from + "targets " + file_targets.second);
  if (!problems.empty()) throw Error(ErrorCode::kRefused, problems);
}

}  // namespace lorastream::worker::dit
