// peft's on-disk format for a causal-LM LoRA adapter: adapter_model.safetensors (keys
// base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight, A [r, in],
// B [out, r]) and adapter_config.json (LoraConfig.to_dict()).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "common/durable_file.h"
#include "common/error.h"
#include "common/safetensors.h"
#include "worker/base_weights.h"
#include "worker/lora.h"

namespace lorastream {

namespace fs = std::filesystem;
using Json = nlohmann::json;

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

  Json alpha = settings_.alpha == std::floor(settings_.alpha) && std::fabs(settings_.alpha) < 1e15
                   ? Json(static_cast<int64_t>(settings_.alpha))
                   : Json(settings_.alpha);
  Json config = {
      {"alpha_pattern", Json::object()},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path", base_model},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layer_replication", nullptr},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"loftq_config", Json::object()},
      {"lora_alpha", alpha},
      {"lora_dropout", settings_.dropout},
      {"megatron_config", nullptr},
      {"megatron_core", "megatron.core"},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", settings_.rank},
      {"rank_pattern", Json::object()},
      {"revision", nullptr},
      {"target_modules", settings_.TargetNames()},
      {"task_type", "CAUSAL_LM"},
      {"use_dora", false},
      {"use_rslora", settings_.rslora},
  };
  WriteFileDurably((fs::path(dir) / "adapter_config.json").string(), config.dump(2) + "\n");
}

LoraAdapter LoraAdapter::Load(const std::string& dir, const ModelConfig& model,
                              c10::Device device) {
  const std::string cfg_path = (fs::path(dir) / "adapter_config.json").string();
  std::ifstream in(cfg_path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kNotFound, cfg_path + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  Json j = Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& field, const std::string& why) {
    return Error(ErrorCode::kCorrupt, cfg_path + ": field `" + field + "` " + why);
  };
  if (j.is_discarded() || !j.is_object()) throw Error(ErrorCode::kCorrupt, cfg_path + ": not a JSON object");
  auto get = [&](const char* field) -> const Json* {
    auto it = j.find(field);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  const Json* v = get("peft_type");
  if (v && (!v->is_string() || v->get<std::string>() != "LORA"))
    throw bad("peft_type", "must be \"LORA\"");
  LoraSettings s;
  v = get("r");
  if (!v || !v->is_number_integer() || v->get<int64_t>() <= 0)
    throw bad("r", "must be a positive integer");
  s.rank = v->get<int64_t>();
  v = get("lora_alpha");
  if (!v || !v->is_number()) throw bad("lora_alpha", "must be a number");
  s.alpha = v->get<double>();
  if ((v = get("lora_dropout"))) {
    if (!v->is_number()) throw bad("lora_dropout", "must be a number");
    s.dropout = v->get<double>();
  }
  if ((v = get("use_rslora"))) {
    if (!v->is_boolean()) throw bad("use_rslora", "must be true or false");
    s.rslora = v->get<bool>();
  }
  for (const char* f : {"rank_pattern", "alpha_pattern"})
    if ((v = get(f)) && !(v->is_object() && v->empty()))
      throw Error(ErrorCode::kUnsupported, cfg_path + ": field `" + f + "` is not supported");
  if ((v = get("use_dora")) && !(v->is_boolean() && !v->get<bool>()))
    throw Error(ErrorCode::kUnsupported, cfg_path + ": DoRA (use_dora) is not supported");
  if ((v = get("fan_in_fan_out")) && !(v->is_boolean() && !v->get<bool>()))
    throw Error(ErrorCode::kUnsupported, cfg_path + ": fan_in_fan_out is not supported");
  if ((v = get("bias")) && !(v->is_string() && v->get<std::string>() == "none"))
    throw Error(ErrorCode::kUnsupported, cfg_path + ": only bias \"none\" is supported");
  if ((v = get("layers_to_transform")))
    throw Error(ErrorCode::kUnsupported, cfg_path + ": layers_to_transform is not supported");
  v = get("target_modules");
  std::vector<std::string> targets;
  if (v && v->is_string()) targets.push_back(v->get<std::string>());
  else if (v && v->is_array())
    for (const auto& e : *v) {
      if (!e.is_string()) throw bad("target_modules", "must hold strings");
      targets.push_back(e.get<std::string>());
    }
  else throw bad("target_modules", "must be a list of module names");
  for (const auto& name : targets) {
    bool found = false;
    for (int t = 0; t < kNumLoraTargets; ++t)
      if (name == LoraTargetName(t)) s.targets[t] = found = true;
    if (!found)
      throw Error(ErrorCode::kUnsupported, cfg_path + ": target module `" + name +
                                               "` is not one of q_proj, k_proj, v_proj, o_proj, "
                                               "gate_proj, up_proj, down_proj");
  }

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
        std::vector<int64_t> want = is_b ? std::vector<int64_t>{fan_out, s.rank}
                                         : std::vector<int64_t>{s.rank, fan_in};
        if (e->shape != want)
          throw Error(ErrorCode::kCorrupt, st_path + ": tensor `" + key + "` has shape [" +
                                               std::to_string(e->shape.size() > 0 ? e->shape[0] : -1) + ", ...] but [" +
                                               std::to_string(want[0]) + ", " +
                                               std::to_string(want[1]) + "] is expected");
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

}  // namespace lorastream
