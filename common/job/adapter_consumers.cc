#include "common/job/adapter_consumers.h"

#include "common/job/job_kind.h"
#include "common/job/job_spec.h"

namespace lorastream {

AdapterFacts AdapterFactsOf(const LoraSpec& lora) {
  AdapterFacts f;
  f.rank = lora.rank;
  f.rslora = lora.rslora;
  return f;  // our adapters never carry a bias or modules_to_save (worker/model/peft_config.h)
}

const std::vector<int64_t>& VllmMaxLoraRanks() {
  static const std::vector<int64_t> ranks = {1, 8, 16, 32, 64, 128, 256, 320, 512};
  return ranks;
}

std::vector<std::string> AdapterConsumerWarnings(const AdapterFacts& f) {
  std::vector<std::string> w;
  const std::string rank = std::to_string(f.rank);
  if (f.rank > VllmMaxLoraRanks().back()) {
    w.push_back("vLLM: rank " + rank +
                " is above 512, the largest --max-lora-rank vLLM accepts (vllm/config/lora.py "
                "MaxLoRARanks): vLLM cannot serve this adapter");
  } else if (f.rank > 16) {
    int64_t flag = 0;
    for (int64_t r : VllmMaxLoraRanks())
      if (flag == 0 && r >= f.rank) flag = r;
    w.push_back("vLLM: rank " + rank +
                " is above vLLM's default --max-lora-rank of 16 (vllm/config/lora.py): serve it "
                "with --max-lora-rank " +
                std::to_string(flag) + " or vLLM refuses it (\"LoRA rank " + rank +
                " is greater than max_lora_rank 16\")");
  }
  if (f.bias != "none")
    w.push_back("vLLM: bias = \"" + f.bias +
                "\": vLLM refuses it (\"Adapter bias cannot be used without bias_enabled\", "
                "vllm/lora/peft_helper.py)");
  if (f.modules_to_save)
    w.push_back(
        "vLLM: modules_to_save is set: vLLM refuses it (\"vLLM only supports modules_to_save "
        "being None\", vllm/lora/peft_helper.py)");
  if (f.rslora)
    w.push_back(
        "llama.cpp: convert_lora_to_gguf.py ignores use_rslora (it scales by lora_alpha / r): "
        "a GGUF made of this adapter applies it at sqrt(r) times its trained strength; merge it "
        "first (lorastream-worker merge) and convert the merged model instead");
  return w;
}

std::vector<std::string> AdapterConsumerWarnings(const JobSpec& spec) {
  if (!IsLanguageModelJob(spec)) return {};
  return AdapterConsumerWarnings(AdapterFactsOf(spec.lora));
}

}  // namespace lorastream
