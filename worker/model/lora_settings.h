// What a LoRA adapter is, without its tensors: the seven target projections of a block, their
// shapes and peft key names, and the settings (rank, alpha, dropout, rsLoRA, targets). Torch-free
// (lorastream_worker_core): adapter_config.json (worker/model/peft_config.h) is read and written
// from these alone; the tensors are worker/model/lora.h's.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/model_config.h"

namespace lorastream {
struct LoraSpec;
}  // namespace lorastream

namespace lorastream::worker {

// The seven projections of a block, in this fixed order. In a mixture of experts
// (qwen3_moe, mixtral) gate_proj, up_proj and down_proj are every expert's (mixtral's w1, w3
// and w2); the router is never adapted.
enum LoraTarget : int { kQProj = 0, kKProj, kVProj, kOProj, kGateProj, kUpProj, kDownProj };
constexpr int kNumLoraTargets = 7;
const char* LoraTargetName(int target);    // "q_proj", ...
const char* LoraTargetModule(int target);  // "self_attn" or "mlp"
// (in_features, out_features) of the projection in this architecture (an expert's for the
// MLP targets of a mixture of experts).
std::pair<int64_t, int64_t> LoraTargetShape(const ModelConfig& config, int target);

struct LoraSettings {
  int64_t rank = 16;
  double alpha = 32.0;
  double dropout = 0.0;
  bool rslora = false;
  std::array<bool, kNumLoraTargets> targets{};   // which projections carry an adapter
  double Scale() const;                          // alpha / r or alpha / sqrt(r)
  std::vector<std::string> TargetNames() const;  // sorted, as peft writes target_modules
  // target_modules for an adapter of `config`: TargetNames, with mixtral's expert names (w1,
  // w3, w2) for gate_proj, up_proj and down_proj.
  std::vector<std::string> PeftTargetNames(const ModelConfig& config) const;
};
LoraSettings LoraSettingsFromSpec(const LoraSpec& spec);

// peft's key for the A or B weight of a target in block `i`, e.g.
// "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
std::string LoraKey(int block, int target, bool is_b);
// The same for a module relative to the block ("mlp.experts.3.gate_proj").
std::string LoraModuleKey(int block, const std::string& module, bool is_b);

// The LoraTarget a target_modules / lora.targets name stands for: the seven projections and
// mixtral's expert names w1 (gate_proj), w3 (up_proj), w2 (down_proj); -1 for another name.
int LoraTargetOf(const std::string& name);

}  // namespace lorastream::worker
