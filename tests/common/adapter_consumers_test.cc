// The rules of the programs that load our LLM adapters (common/job/adapter_consumers.h): each
// broken rule is one warning naming the consumer and the rule.
#include <catch2/catch.hpp>

#include "common/job/adapter_consumers.h"
#include "common/job/job_kind.h"
#include "common/job/job_spec.h"

using namespace lorastream;

namespace {

std::string All(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

}  // namespace

TEST_CASE("adapter consumers: vLLM's rank, bias and modules_to_save rules, llama.cpp's scale",
          "[common]") {
  LoraSpec lora;  // rank 16, no rslora: every consumer loads it as it is
  CHECK(AdapterConsumerWarnings(AdapterFactsOf(lora)).empty());
  lora.rank = 4;  // under vLLM's default --max-lora-rank
  CHECK(AdapterConsumerWarnings(AdapterFactsOf(lora)).empty());

  lora.rank = 48;  // needs --max-lora-rank 64
  std::vector<std::string> w = AdapterConsumerWarnings(AdapterFactsOf(lora));
  REQUIRE(w.size() == 1);
  CHECK_THAT(w[0], Catch::StartsWith("vLLM: rank 48"));
  CHECK_THAT(w[0], Catch::Contains("--max-lora-rank 64"));
  lora.rank = 320;
  CHECK_THAT(All(AdapterConsumerWarnings(AdapterFactsOf(lora))),
             Catch::Contains("--max-lora-rank 320"));
  lora.rank = 1024;
  CHECK_THAT(All(AdapterConsumerWarnings(AdapterFactsOf(lora))),
             Catch::Contains("vLLM cannot serve"));

  lora.rank = 16;
  lora.rslora = true;
  w = AdapterConsumerWarnings(AdapterFactsOf(lora));
  REQUIRE(w.size() == 1);
  CHECK_THAT(w[0], Catch::StartsWith("llama.cpp: convert_lora_to_gguf.py ignores use_rslora"));

  AdapterFacts facts;
  facts.rank = 8;
  facts.bias = "all";
  facts.modules_to_save = true;
  w = AdapterConsumerWarnings(facts);
  REQUIRE(w.size() == 2);
  CHECK_THAT(w[0], Catch::Contains("bias_enabled"));
  CHECK_THAT(w[1], Catch::Contains("modules_to_save being None"));

  // lora.init_from leaving the rank to the adapter: nothing to say before it is read.
  lora.rslora = false;
  lora.rank = 0;
  CHECK(AdapterConsumerWarnings(AdapterFactsOf(lora)).empty());
}

TEST_CASE(
    "adapter consumers: a job's warnings are its LoRA's for a language model, none for a "
    "diffusion family's job",
    "[common]") {
  JobSpec job;
  job.lora.rank = 48;  // above vLLM's default --max-lora-rank
  REQUIRE(IsLanguageModelJob(job));
  CHECK(All(AdapterConsumerWarnings(job)) ==
        All(AdapterConsumerWarnings(AdapterFactsOf(job.lora))));
  CHECK_FALSE(AdapterConsumerWarnings(job).empty());
  job.is_qwen_image = true;  // ComfyUI and diffusers load it: vLLM's rules are not theirs
  CHECK_FALSE(IsLanguageModelJob(job));
  CHECK(AdapterConsumerWarnings(job).empty());
  job.is_qwen_image = false;
  job.is_flux = true;
  CHECK_FALSE(IsLanguageModelJob(job));
  CHECK(AdapterConsumerWarnings(job).empty());
}
