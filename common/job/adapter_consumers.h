// What the programs that load a peft LLM adapter require of it, as warnings: an adapter that
// breaks one of these rules still trains and other consumers still load it, so `submit` and
// `lorastream-worker train` warn (naming the consumer, its rule and where the rule is) rather
// than refuse. Torch-free. The rules, from the consumers' sources:
//   vLLM (vllm/config/lora.py MaxLoRARanks, vllm/lora/peft_helper.py): the server's
//     --max-lora-rank is one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (default 16) and an
//     adapter of a higher rank is refused ("LoRA rank R is greater than max_lora_rank M");
//     an adapter with a bias or modules_to_save is refused.
//   llama.cpp (convert_lora_to_gguf.py): reads lora_alpha and the lora_A/lora_B tensors only;
//     its scale is alpha / r, so use_rslora's alpha / sqrt(r) is lost in the conversion.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream {

struct JobSpec;
struct LoraSpec;

// What the rules look at.
struct AdapterFacts {
  int64_t rank = 0;  // 0: not known yet (lora.init_from leaves it to the adapter)
  bool rslora = false;
  std::string bias = "none";     // adapter_config.json `bias`
  bool modules_to_save = false;  // adapter_config.json `modules_to_save` non-empty
};
AdapterFacts AdapterFactsOf(const LoraSpec& lora);

// vLLM's --max-lora-rank values.
const std::vector<int64_t>& VllmMaxLoraRanks();

// One line per rule broken, each starting with the consumer's name ("vLLM: ...").
std::vector<std::string> AdapterConsumerWarnings(const AdapterFacts& facts);

// A job's warnings: its LoRA's facts against the rules, for a language-model job (the rules
// are LLM adapters'); none for a diffusion family's job (common/job/job_kind.h).
std::vector<std::string> AdapterConsumerWarnings(const JobSpec& spec);

}  // namespace lorastream
