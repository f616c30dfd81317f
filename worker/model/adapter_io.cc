// peft's on-disk format for a causal-LM LoRA adapter: adapter_model.safetensors (keys
// base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight, A [r, in],
// B [out, r]), here, and adapter_config.json (LoraConfig.to_dict()), worker/model/peft_config.h.
#include <filesystem>
#include <set>

#include <ATen/ATen.h>

#include "common/durable_file.h"
#include "common/error.h"
#include "common/safetensors.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/peft_config.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

void LoraAdapter::Save(const std::string& dir, const std::string& base_model) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot create " + dir + ": " + ec.message());
  std::vector<at::Tensor> host;  // keeps the CPU copies alive while writing
  std::vector<TensorToWrite> tensors;
  const auto names = ParamNames();
  const auto params = Params();
  for (size_t i = 0; i < params.size(); ++i) {
    host.push_back(params[i].detach().to(at::kCPU, at::kFloat).contiguous());
    TensorToWrite t;
    t.name = names[i];
    t.dtype = DType::kF32;
    t.shape = host.back().sizes().vec();
    t.data = host.back().data_ptr();
    tensors.push_back(t);
  }
  WriteSafetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors,
                   {{"format", "pt"}});

  WriteFileDurably((fs::path(dir) / "adapter_config.json").string(),
                   PeftConfigJson(settings_, base_model));
}

LoraAdapter LoraAdapter::Load(const std::string& dir, const ModelConfig& model,
                              c10::Device device) {
  const LoraSettings s = ReadPeftConfig((fs::path(dir) / "adapter_config.json").string());

  const std::string st_path = (fs::path(dir) / "adapter_model.safetensors").string();
  SafetensorsFile file = SafetensorsFile::Open(st_path);
  LoraAdapter a;
  a.config_ = model;
  a.settings_ = s;
  std::set<std::string> used;
  for (int64_t i = 0; i < model.num_hidden_layers; ++i) {
    LoraBlock blk;
    for (int t = 0; t < kNumLoraTargets; ++t) {
      if (!s.targets[t]) continue;
      auto [fan_in, fan_out] = LoraTargetShape(model, t);
      for (bool is_b : {false, true}) {
        const std::string key = LoraKey(static_cast<int>(i), t, is_b);
        const SafetensorsEntry* e = file.Find(key);
        if (!e) throw Error(ErrorCode::kCorrupt, st_path + ": tensor `" + key + "` is missing");
        std::vector<int64_t> want =
            is_b ? std::vector<int64_t>{fan_out, s.rank} : std::vector<int64_t>{s.rank, fan_in};
        if (e->shape != want)
          throw Error(ErrorCode::kCorrupt,
                      st_path + ": tensor `" + key + "` has shape [" +
                          std::to_string(e->shape.size() > 0 ? e->shape[0] : -1) + ", ...] but [" +
                          std::to_string(want[0]) + ", " + std::to_string(want[1]) +
                          "] is expected");
        auto type = ScalarTypeOf(e->dtype, key);
        at::Tensor view = at::from_blob(const_cast<uint8_t*>(file.Data(*e)), want,
                                        at::TensorOptions().dtype(type));
        at::Tensor master = view.to(at::kFloat).clone().to(device).requires_grad_(true);
        (is_b ? blk.b[t] : blk.a[t]) = master;
        used.insert(key);
      }
    }
    a.blocks_.push_back(std::move(blk));
  }
  for (const auto& e : file.tensors())
    if (!used.count(e.name))
      throw Error(ErrorCode::kUnsupported, st_path + ": unexpected tensor `" + e.name +
                                               "` (not a LoRA weight of this model and config)");
  return a;
}

}  // namespace lorastream::worker
