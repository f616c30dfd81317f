#include "worker/model/lora_settings.h"

#include <algorithm>
#include <cmath>

#include "common/base/error.h"
#include "common/job/job_spec.h"

namespace lorastream::worker {

const char* LoraTargetName(int t) {
  static const char* kNames[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                 "gate_proj", "up_proj", "down_proj"};
  LS_CHECK(t >= 0 && t < kNumLoraTargets, "target index");
  return kNames[t];
}

const char* LoraTargetModule(int t) { return t <= kOProj ? "self_attn" : "mlp"; }

std::pair<int64_t, int64_t> LoraTargetShape(const ModelConfig& c, int t) {
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  switch (t) {
    case kQProj:
      return {c.hidden_size, q};
    case kKProj:
    case kVProj:
      return {c.hidden_size, kv};
    case kOProj:
      return {q, c.hidden_size};
    case kGateProj:
    case kUpProj:
      return {c.hidden_size, c.is_moe() ? c.moe_intermediate_size : c.intermediate_size};
    case kDownProj:
      return {c.is_moe() ? c.moe_intermediate_size : c.intermediate_size, c.hidden_size};
  }
  LS_CHECK(false, "target index");
  return {0, 0};
}

double LoraSettings::Scale() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

std::vector<std::string> LoraSettings::TargetNames() const {
  std::vector<std::string> names;
  for (int t = 0; t < kNumLoraTargets; ++t)
    if (targets[t]) names.push_back(LoraTargetName(t));
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> LoraSettings::PeftTargetNames(const ModelConfig& config) const {
  std::vector<std::string> names;
  for (int t = 0; t < kNumLoraTargets; ++t)
    if (targets[t])
      names.push_back(config.model_type == "mixtral" && t >= kGateProj
                          ? config.ExpertProjName(t - kGateProj)
                          : LoraTargetName(t));
  std::sort(names.begin(), names.end());
  return names;
}

int LoraTargetOf(const std::string& name) {
  for (int t = 0; t < kNumLoraTargets; ++t)
    if (name == LoraTargetName(t)) return t;
  if (name == "w1") return kGateProj;
  if (name == "w3") return kUpProj;
  if (name == "w2") return kDownProj;
  return -1;
}

LoraSettings LoraSettingsFromSpec(const LoraSpec& spec) {
  LoraSettings s;
  s.rank = spec.rank;
  s.alpha = spec.alpha;
  s.dropout = spec.dropout;
  s.rslora = spec.rslora;
  for (const auto& name : spec.targets) {
    if (name == "experts") {  // a mixture of experts' gate, up and down projections, per expert
      s.targets[kGateProj] = s.targets[kUpProj] = s.targets[kDownProj] = true;
      continue;
    }
    const int t = LoraTargetOf(name);
    if (t < 0) throw Error(ErrorCode::kRefused, "lora.targets: unknown module `" + name + "`");
    s.targets[t] = true;
  }
  return s;
}

std::string LoraModuleKey(int block, const std::string& module, bool is_b) {
  return "base_model.model.model.layers." + std::to_string(block) + "." + module +
         (is_b ? ".lora_B.weight" : ".lora_A.weight");
}

std::string LoraKey(int block, int target, bool is_b) {
  return LoraModuleKey(block, std::string(LoraTargetModule(target)) + "." + LoraTargetName(target),
                       is_b);
}

}  // namespace lorastream::worker
