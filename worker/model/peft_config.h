// peft's adapter_config.json (LoraConfig.to_dict()) for a causal-LM LoRA adapter: written
// from LoraSettings, and read back with every field this trainer cannot honour refused. The
// tensors beside it (adapter_model.safetensors) are LoraAdapter::Save/Load's
// (worker/model/adapter_io.cc).
#pragma once

#include <string>

#include "worker/model/lora_settings.h"

namespace lorastream::worker {

// The JSON text peft writes for `settings` (keys sorted, as peft's to_dict() gives them);
// target_modules in `model`'s names when given (mixtral's experts: w1, w3, w2).
std::string PeftConfigJson(const LoraSettings& settings, const std::string& base_model,
                           const ModelConfig* model = nullptr);

// Reads and validates the adapter_config.json at `path`: Error(kNotFound) when it cannot be
// opened, Error(kCorrupt) naming the field for a wrong type or value, Error(kUnsupported)
// naming what peft feature (DoRA, rank_pattern, bias, a target module, ...) is not supported.
LoraSettings ReadPeftConfig(const std::string& path);

}  // namespace lorastream::worker
