#include "common/formats/model_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {

using Json = nlohmann::json;

[[noreturn]] void Bad(const std::string& source, const std::string& field, const std::string& why) {
  throw Error(ErrorCode::kCorrupt, source + ": field `" + field + "` " + why);
}

int64_t RequirePositiveInt(const Json& j, const std::string& source, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) Bad(source, field, "is missing");
  if (!it->is_number_integer()) Bad(source, field, "must be an integer");
  int64_t v = it->get<int64_t>();
  if (v <= 0 || v > (int64_t{1} << 40)) Bad(source, field, "must be a positive integer");
  return v;
}

double GetNumber(const Json& j, const std::string& source, const char* field, double fallback) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number()) Bad(source, field, "must be a number");
  return it->get<double>();
}

double GetPositiveNumber(const Json& j, const std::string& source, const char* field,
                         double fallback) {
  const double v = GetNumber(j, source, field, fallback);
  if (!(v > 0) || !std::isfinite(v)) Bad(source, field, "must be a positive number");
  return v;
}

// An optional integer in [0, 2^40]; `fallback` when absent or null.
int64_t GetCount(const Json& j, const std::string& source, const char* field, int64_t fallback) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) Bad(source, field, "must be an integer");
  const int64_t v = it->get<int64_t>();
  if (v < 0 || v > (int64_t{1} << 40)) Bad(source, field, "must be in [0, 2^40]");
  return v;
}

bool GetBool(const Json& j, const std::string& source, const char* field, bool fallback) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) Bad(source, field, "must be true or false");
  return it->get<bool>();
}

[[noreturn]] void Refuse(const std::string& source, const std::string& field,
                         const std::string& why) {
  throw Error(ErrorCode::kUnsupported, source + ": field `" + field + "` " + why);
}

// The experts of a qwen3_moe or mixtral config.json (ModelConfig's MoE fields).
void ParseMoe(const Json& j, const std::string& source, ModelConfig& c) {
  if (c.model_type != "qwen3_moe" && c.model_type != "mixtral") return;
  const bool qwen = c.model_type == "qwen3_moe";
  // The Hub's Qwen3-MoE configs say num_experts; transformers 5 saves it as num_local_experts
  // (Mixtral's name), which it maps back.
  const char* experts_key = qwen && (j.contains("num_experts") || !j.contains("num_local_experts"))
                                ? "num_experts"
                                : "num_local_experts";
  c.num_experts = RequirePositiveInt(j, source, experts_key);
  c.num_experts_per_tok = RequirePositiveInt(j, source, "num_experts_per_tok");
  if (c.num_experts_per_tok > c.num_experts)
    Bad(source, "num_experts_per_tok", "must not exceed the number of experts");
  if (c.num_experts > 4096) Refuse(source, experts_key, "> 4096");
  c.moe_intermediate_size =
      qwen ? RequirePositiveInt(j, source, "moe_intermediate_size") : c.intermediate_size;
  c.norm_topk_prob = qwen ? GetBool(j, source, "norm_topk_prob", false) : true;
  if (qwen) {
    if (GetCount(j, source, "decoder_sparse_step", 1) != 1)
      Refuse(source, "decoder_sparse_step",
             "must be 1: dense MLP layers among the sparse ones are not supported");
    auto only = j.find("mlp_only_layers");
    if (only != j.end() && !only->is_null() && !(only->is_array() && only->empty()))
      Refuse(source, "mlp_only_layers",
             "must be empty: dense MLP layers among the sparse ones are not supported");
    if (GetCount(j, source, "shared_expert_intermediate_size", 0) != 0)
      Refuse(source, "shared_expert_intermediate_size",
             "is not 0: shared experts are not supported");
  } else if (GetNumber(j, source, "router_jitter_noise", 0.0) != 0.0) {
    Refuse(source, "router_jitter_noise", "is not 0: router jitter is not supported");
  }
}

}  // namespace

std::string ModelConfig::MoeModule() const {
  return model_type == "mixtral" ? "block_sparse_moe" : "mlp";
}

const char* ModelConfig::ExpertProjName(int proj) const {
  static const char* kQwen[] = {"gate_proj", "up_proj", "down_proj"};
  static const char* kMixtral[] = {"w1", "w3", "w2"};
  LS_CHECK(proj >= 0 && proj < 3, "expert projection index");
  return model_type == "mixtral" ? kMixtral[proj] : kQwen[proj];
}

std::string ModelConfig::ExpertModule(int64_t expert, int proj) const {
  return MoeModule() + ".experts." + std::to_string(expert) + "." + ExpertProjName(proj);
}

// quantization_config of a pre-quantised checkpoint (ModelConfig::checkpoint_quant).
QuantInfo ParseQuantizationConfig(const Json& q, const std::string& source) {
  const std::string at = "quantization_config.";
  if (!q.is_object()) Bad(source, "quantization_config", "must be an object");
  auto method = q.find("quant_method");
  if (method == q.end() || !method->is_string())
    Bad(source, at + "quant_method", "is missing or not a string");
  const std::string name = method->get<std::string>();
  QuantInfo info;
  if (name == "fp8") {
    auto fmt = q.find("fmt");
    if (fmt != q.end() && !(fmt->is_string() && fmt->get<std::string>() == "e4m3"))
      throw Error(ErrorCode::kUnsupported,
                  source + ": " + at + "fmt `" + fmt->dump() + "` is not supported (e4m3)");
    auto block = q.find("weight_block_size");
    if (block == q.end() || !block->is_array() || block->size() != 2 ||
        !(*block)[0].is_number_integer() || !(*block)[1].is_number_integer() ||
        (*block)[0].get<int64_t>() <= 0 || (*block)[1].get<int64_t>() <= 0 ||
        (*block)[0].get<int64_t>() > (1 << 20) || (*block)[1].get<int64_t>() > (1 << 20))
      throw Error(ErrorCode::kUnsupported,
                  source + ": " + at +
                      "weight_block_size must be [rows, cols]: only block-scaled fp8 "
                      "checkpoints are read (per-tensor or per-channel scales are not)");
    info.method = QuantMethod::kFp8;
    info.block_rows = (*block)[0].get<int64_t>();
    info.block_cols = (*block)[1].get<int64_t>();
    return info;
  }
  if (name == "bitsandbytes") {
    if (!GetBool(q, source, "load_in_4bit", false))
      throw Error(ErrorCode::kUnsupported,
                  source + ": " + at +
                      "load_in_4bit is not true: only bitsandbytes 4-bit nf4 checkpoints are read "
                      "(not LLM.int8)");
    auto type = q.find("bnb_4bit_quant_type");
    const std::string t = type != q.end() && type->is_string() ? type->get<std::string>() : "fp4";
    if (t != "nf4")
      throw Error(ErrorCode::kUnsupported,
                  source + ": " + at + "bnb_4bit_quant_type `" + t + "` is not supported (nf4)");
    if (!GetBool(q, source, "bnb_4bit_use_double_quant", false))
      throw Error(ErrorCode::kUnsupported,
                  source + ": " + at +
                      "bnb_4bit_use_double_quant is not true: only double-quantised nf4 is read");
    info.method = QuantMethod::kNf4;
    info.blocksize = 64;  // the defaults; each tensor's quant_state says its own
    info.nested_blocksize = 256;
    return info;
  }
  throw Error(ErrorCode::kUnsupported,
              source + ": " + at + "quant_method `" + name +
                  "` is not supported (fp8 with weight_block_size; bitsandbytes 4-bit nf4)");
}

ModelConfig ModelConfigFromJson(const Json& j, const std::string& source) {
  if (!j.is_object()) throw Error(ErrorCode::kCorrupt, source + ": not a JSON object");
  ModelConfig c;
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) Bad(source, "model_type", "is missing or not a string");
  c.model_type = mt->get<std::string>();
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2" &&
      c.model_type != "qwen3" && c.model_type != "qwen3_moe" && c.model_type != "mixtral")
    throw Error(ErrorCode::kUnsupported,
                source + ": model_type `" + c.model_type +
                    "` is not supported (supported: llama, mistral, qwen2, qwen3, qwen3_moe, "
                    "mixtral)");
  c.hidden_size = RequirePositiveInt(j, source, "hidden_size");
  c.intermediate_size = RequirePositiveInt(j, source, "intermediate_size");
  ParseMoe(j, source, c);
  c.num_hidden_layers = RequirePositiveInt(j, source, "num_hidden_layers");
  c.num_attention_heads = RequirePositiveInt(j, source, "num_attention_heads");
  c.num_key_value_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                              ? RequirePositiveInt(j, source, "num_key_value_heads")
                              : c.num_attention_heads;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    c.head_dim = RequirePositiveInt(j, source, "head_dim");
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      Bad(source, "num_attention_heads", "must divide hidden_size when head_dim is absent");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    Bad(source, "num_key_value_heads", "must divide num_attention_heads");
  if (c.head_dim % 2 != 0) Bad(source, "head_dim", "must be even (rotary embeddings)");
  c.vocab_size = RequirePositiveInt(j, source, "vocab_size");
  c.max_position_embeddings = j.contains("max_position_embeddings")
                                  ? RequirePositiveInt(j, source, "max_position_embeddings")
                                  : 2048;
  c.rms_norm_eps = GetPositiveNumber(j, source, "rms_norm_eps", 1e-6);
  c.rope_theta = GetPositiveNumber(j, source, "rope_theta", 10000.0);
  c.tie_word_embeddings = GetBool(j, source, "tie_word_embeddings", false);
  c.attention_bias = c.model_type == "qwen2" || GetBool(j, source, "attention_bias", false);
  c.qk_norm = c.model_type == "qwen3" || c.model_type == "qwen3_moe";
  auto sw = j.find("sliding_window");
  if (sw != j.end() && !sw->is_null() && c.model_type != "llama") {
    int64_t window = RequirePositiveInt(j, source, "sliding_window");
    bool used = c.model_type == "mistral" || c.model_type == "mixtral";
    if (c.model_type == "qwen2" || c.model_type == "qwen3" || c.model_type == "qwen3_moe") {
      const int64_t first = GetCount(j, source, "max_window_layers", 0);
      used = GetBool(j, source, "use_sliding_window", false) && first < c.num_hidden_layers;
    }
    auto lt = j.find("layer_types");
    if (lt != j.end() && lt->is_array())
      for (const auto& t : *lt) used = used || (t.is_string() && t == "sliding_attention");
    if (used) c.sliding_window = window;
  }
  auto qc = j.find("quantization_config");
  if (qc != j.end() && !qc->is_null()) c.checkpoint_quant = ParseQuantizationConfig(*qc, source);
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string())
    c.torch_dtype = j["torch_dtype"].get<std::string>();
  auto rs = j.find("rope_scaling");
  // transformers >= 5 writes "rope_parameters" (rope_type, rope_theta, scaling fields) instead
  // of rope_theta + rope_scaling.
  auto rp = j.find("rope_parameters");
  if (rp != j.end() && rp->is_object()) {
    if (!j.contains("rope_theta"))
      c.rope_theta = GetPositiveNumber(*rp, source, "rope_theta", 10000.0);
    if (rs == j.end() || rs->is_null()) rs = rp;
  }
  if (rs != j.end() && !rs->is_null()) {
    if (!rs->is_object()) Bad(source, "rope_scaling", "must be an object or null");
    std::string type;
    if (rs->contains("rope_type") && (*rs)["rope_type"].is_string())
      type = (*rs)["rope_type"].get<std::string>();
    else if (rs->contains("type") && (*rs)["type"].is_string())
      type = (*rs)["type"].get<std::string>();
    if (type != "llama3" && type != "linear" && type != "default")
      throw Error(ErrorCode::kUnsupported, source + ": rope_scaling type `" + type +
                                               "` is not supported (llama3, linear, default)");
    if (type != "default") {
      c.rope_scaling.type = type;
      c.rope_scaling.factor = GetPositiveNumber(*rs, source, "factor", 1.0);
      c.rope_scaling.low_freq_factor = GetPositiveNumber(*rs, source, "low_freq_factor", 1.0);
      c.rope_scaling.high_freq_factor = GetPositiveNumber(*rs, source, "high_freq_factor", 4.0);
      c.rope_scaling.original_max_position_embeddings =
          GetCount(*rs, source, "original_max_position_embeddings", 8192);
      if (c.rope_scaling.original_max_position_embeddings == 0)
        Bad(source, "original_max_position_embeddings", "must be a positive integer");
    }
  }
  return c;
}

ModelConfig ParseModelConfig(const std::string& json_text, const std::string& source) {
  Json j = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error(ErrorCode::kCorrupt, source + ": not valid JSON");
  return ModelConfigFromJson(j, source);
}

ModelConfig LoadModelConfig(const std::string& path) {
  return ParseModelConfig(ReadRegularFile(path, kMaxTextFileBytes, "config.json"), path);
}

void ToJson(Json& out, const ModelConfig& c) {
  std::string arch = c.model_type == "llama"       ? "LlamaForCausalLM"
                     : c.model_type == "mistral"   ? "MistralForCausalLM"
                     : c.model_type == "qwen2"     ? "Qwen2ForCausalLM"
                     : c.model_type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                     : c.model_type == "mixtral"   ? "MixtralForCausalLM"
                                                   : "Qwen3ForCausalLM";
  out = Json{{"architectures", {arch}},
             {"model_type", c.model_type},
             {"hidden_size", c.hidden_size},
             {"intermediate_size", c.intermediate_size},
             {"num_hidden_layers", c.num_hidden_layers},
             {"num_attention_heads", c.num_attention_heads},
             {"num_key_value_heads", c.num_key_value_heads},
             {"head_dim", c.head_dim},
             {"vocab_size", c.vocab_size},
             {"max_position_embeddings", c.max_position_embeddings},
             {"rms_norm_eps", c.rms_norm_eps},
             {"rope_theta", c.rope_theta},
             {"tie_word_embeddings", c.tie_word_embeddings},
             {"attention_bias", c.attention_bias},
             {"hidden_act", "silu"},
             {"torch_dtype", c.torch_dtype.empty() ? "bfloat16" : c.torch_dtype}};
  if (c.model_type != "llama")
    out["sliding_window"] = c.sliding_window > 0 ? Json(c.sliding_window) : Json(nullptr);
  if (c.model_type == "qwen2" || c.model_type == "qwen3" || c.model_type == "qwen3_moe")
    out["use_sliding_window"] = c.sliding_window > 0;
  if (c.model_type == "qwen3_moe") {
    out["num_experts"] = c.num_experts;
    out["moe_intermediate_size"] = c.moe_intermediate_size;
    out["norm_topk_prob"] = c.norm_topk_prob;
    out["decoder_sparse_step"] = 1;
    out["mlp_only_layers"] = Json::array();
  } else if (c.model_type == "mixtral") {
    out["num_local_experts"] = c.num_experts;
    out["router_jitter_noise"] = 0.0;
  }
  if (c.is_moe()) {
    out["num_experts_per_tok"] = c.num_experts_per_tok;
    out["output_router_logits"] = false;
  }
  if (c.rope_scaling.type.empty()) {
    out["rope_scaling"] = nullptr;
  } else {
    out["rope_scaling"] =
        Json{{"rope_type", c.rope_scaling.type},
             {"factor", c.rope_scaling.factor},
             {"low_freq_factor", c.rope_scaling.low_freq_factor},
             {"high_freq_factor", c.rope_scaling.high_freq_factor},
             {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  }
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelConfig::BlockTensorShapes() const {
  const int64_t q = num_attention_heads * head_dim;
  const int64_t kv = num_key_value_heads * head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> t = {
      {"input_layernorm.weight", {hidden_size}},
      {"self_attn.q_proj.weight", {q, hidden_size}},
      {"self_attn.k_proj.weight", {kv, hidden_size}},
      {"self_attn.v_proj.weight", {kv, hidden_size}},
      {"self_attn.o_proj.weight", {hidden_size, q}},
  };
  if (attention_bias) {
    t.push_back({"self_attn.q_proj.bias", {q}});
    t.push_back({"self_attn.k_proj.bias", {kv}});
    t.push_back({"self_attn.v_proj.bias", {kv}});
  }
  if (qk_norm) {
    t.push_back({"self_attn.q_norm.weight", {head_dim}});
    t.push_back({"self_attn.k_norm.weight", {head_dim}});
  }
  t.push_back({"post_attention_layernorm.weight", {hidden_size}});
  if (is_moe()) {
    // The router, then each expert's gate, up and down (the checkpoint's names).
    t.push_back({MoeModule() + ".gate.weight", {num_experts, hidden_size}});
    const int64_t inter = moe_intermediate_size;
    for (int64_t e = 0; e < num_experts; ++e) {
      t.push_back({ExpertModule(e, 0) + ".weight", {inter, hidden_size}});
      t.push_back({ExpertModule(e, 1) + ".weight", {inter, hidden_size}});
      t.push_back({ExpertModule(e, 2) + ".weight", {hidden_size, inter}});
    }
    return t;
  }
  t.push_back({"mlp.gate_proj.weight", {intermediate_size, hidden_size}});
  t.push_back({"mlp.up_proj.weight", {intermediate_size, hidden_size}});
  t.push_back({"mlp.down_proj.weight", {hidden_size, intermediate_size}});
  return t;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelConfig::RestTensorShapes() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t = {
      {"model.embed_tokens.weight", {vocab_size, hidden_size}},
      {"model.norm.weight", {hidden_size}},
  };
  if (!tie_word_embeddings) t.push_back({"lm_head.weight", {vocab_size, hidden_size}});
  return t;
}

}  // namespace lorastream
