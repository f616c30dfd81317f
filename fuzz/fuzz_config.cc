// libFuzzer target for the two human-written inputs a user hands us: a model's config.json
// and a job file (TOML). Either parses or throws lorastream::Error (anything else escaping,
// or a sanitizer report, is a finding). A config that parses must survive the manifest's
// JSON unchanged, and a job that parses is validated against it without crashing.
#include <cstdint>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/model_config.h"
#include "common/job/job_spec.h"

using namespace lorastream;

namespace {

bool Same(const ModelConfig& a, const ModelConfig& b) {
  return a.model_type == b.model_type && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_hidden_layers == b.num_hidden_layers &&
         a.num_attention_heads == b.num_attention_heads &&
         a.num_key_value_heads == b.num_key_value_heads && a.head_dim == b.head_dim &&
         a.vocab_size == b.vocab_size && a.max_position_embeddings == b.max_position_embeddings &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope_theta == b.rope_theta &&
         a.rope_scaling.type == b.rope_scaling.type &&
         a.tie_word_embeddings == b.tie_word_embeddings && a.attention_bias == b.attention_bias &&
         a.qk_norm == b.qk_norm && a.sliding_window == b.sliding_window;
}

// The model a fuzzed job is validated against: small, with a sliding window.
const char* kTinyModel = R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
  "max_position_embeddings": 256, "sliding_window": 128})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    ModelConfig c = ParseModelConfig(text, "config.json");
    nlohmann::json out;
    ToJson(out, c);
    if (!Same(c, ModelConfigFromJson(out, "manifest"))) std::abort();
  } catch (const Error&) {
  }
  try {
    JobSpec spec = ParseJobSpec(text, "job.toml");
    static const ModelConfig model = ParseModelConfig(kTinyModel, "tiny");
    ValidateJobSpec(spec, &model);
  } catch (const Error&) {
  }
  return 0;
}
