#include "worker/model/peft_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/base/error.h"

namespace lorastream::worker {

using Json = nlohmann::json;

std::string PeftConfigJson(const LoraSettings& settings, const std::string& base_model,
                           const ModelConfig* model) {
  Json alpha = settings.alpha == std::floor(settings.alpha) && std::fabs(settings.alpha) < 1e15
                   ? Json(static_cast<int64_t>(settings.alpha))
                   : Json(settings.alpha);
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
      {"lora_dropout", settings.dropout},
      {"megatron_config", nullptr},
      {"megatron_core", "megatron.core"},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", settings.rank},
      {"rank_pattern", Json::object()},
      {"revision", nullptr},
      {"target_modules", model ? settings.PeftTargetNames(*model) : settings.TargetNames()},
      {"task_type", "CAUSAL_LM"},
      {"use_dora", false},
      {"use_rslora", settings.rslora},
  };
  return config.dump(2) + "\n";
}

LoraSettings ReadPeftConfig(const std::string& cfg_path) {
  std::ifstream in(cfg_path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kNotFound, cfg_path + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  Json j = Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& field, const std::string& why) {
    return Error(ErrorCode::kCorrupt, cfg_path + ": field `" + field + "` " + why);
  };
  if (j.is_discarded() || !j.is_object())
    throw Error(ErrorCode::kCorrupt, cfg_path + ": not a JSON object");
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
  if (v && v->is_string())
    targets.push_back(v->get<std::string>());
  else if (v && v->is_array())
    for (const auto& e : *v) {
      if (!e.is_string()) throw bad("target_modules", "must hold strings");
      targets.push_back(e.get<std::string>());
    }
  else
    throw bad("target_modules", "must be a list of module names");
  for (const auto& name : targets) {
    const int t = LoraTargetOf(name);
    if (t < 0)
      throw Error(ErrorCode::kUnsupported, cfg_path + ": target module `" + name +
                                               "` is not one of q_proj, k_proj, v_proj, o_proj, "
                                               "gate_proj, up_proj, down_proj (mixtral: w1, w3, "
                                               "w2)");
    s.targets[t] = true;
  }
  if ((v = get("target_parameters")) && !(v->is_array() && v->empty()))
    throw Error(ErrorCode::kUnsupported,
                cfg_path +
                    ": field `target_parameters` is not supported (experts are read per "
                    "expert, as target_modules gate_proj/up_proj/down_proj name them)");
  return s;
}

}  // namespace lorastream::worker
