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

#include "common/model_config.h"

namespace lorastream {
struct LoraSpec;
}  // namespace lorastream

namespace lorastream::worker {

// The seven projections of a block, in this fixed order.
enum LoraTarget : int { kQProj = 0, kKProj, kVProj, kOProj, kGateProj, kUpProj, kDownProj };
constexpr int kNumLoraTargets = 7;
const char* LoraTargetName(int target);    // "q_proj", ...
const char* LoraTargetModule(int target);  // "self_attn" or "mlp"
// (in_features, out_features) of the projection in this architecture.
std::pair<int64_t, int64_t> LoraTargetShape(const ModelConfig& config, int target);

struct LoraSettings {
  int64_t rank = 16;
  double alpha = 32.0;
  double dropout = 0.0;
  bool rslora = false;
  std::array<bool, kNumLoraTargets> targets{};   // which projections carry an adapter
  double Scale() const;                          // alpha / r or alpha / sqrt(r)
  std::vector<std::string> TargetNames() const;  // sorted, as peft writes target_modules
};
LoraSettings LoraSettingsFromSpec(const LoraSpec& spec);

// peft's key for the A or B weight of a target in block `i`, e.g.
// "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
std::string LoraKey(int block, int target, bool is_b);

}  // namespace lorastream::worker
