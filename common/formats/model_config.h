// Architecture of a Hugging Face causal LM of the Llama family (llama, mistral, qwen2, qwen3)
// or one of its mixtures of experts (qwen3_moe, mixtral: the block's MLP is a router and
// experts), read from config.json. Torch-free: the store validates shapes with it, the worker
// builds its model from it, and it travels inside the store's manifest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/formats/quant_format.h"

namespace lorastream {

struct RopeScaling {
  std::string type;  // "" (none), "llama3", "linear"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string model_type;  // llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // hidden_size / num_attention_heads unless config.json says
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v bias (qwen2: always true)
  bool qk_norm = false;         // q_norm / k_norm per head (qwen3)
  // Sliding-window attention is not implemented: this is the window of the layers that use one
  // (0 = none), so that a job whose sequences are longer than it is refused. Within the window
  // full causal attention is the same computation. mistral uses `sliding_window` whenever it
  // is set; qwen2/qwen3 only with `use_sliding_window` (and layers >= `max_window_layers`);
  // transformers 5 may list "sliding_attention" in `layer_types`.
  int64_t sliding_window = 0;
  std::string torch_dtype;  // as written in config.json ("bfloat16", ...)
  // Mixture of experts (qwen3_moe, mixtral; 0 experts: a dense MLP). Every block's MLP is a
  // router (`gate`, [num_experts, hidden]) choosing num_experts_per_tok experts per token from
  // a softmax over all experts (renormalised over the chosen ones when norm_topk_prob:
  // qwen3_moe's setting, always for mixtral), each expert a gated MLP of
  // moe_intermediate_size (mixtral: intermediate_size), their outputs summed with those
  // weights. Shared experts, dense layers among sparse ones (decoder_sparse_step != 1,
  // mlp_only_layers) and router jitter are refused by name.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  // config.json's quantization_config: how a pre-quantised checkpoint stores its projection
  // weights (quant_method "fp8" with weight_block_size; "bitsandbytes" 4-bit nf4 with double
  // quantisation, its block sizes per tensor in quant_state). Anything else is refused by
  // name. Not part of ToJson: a store records each tensor's format in its manifest instead.
  QuantInfo checkpoint_quant;

  bool is_moe() const { return num_experts > 0; }
  // Where a MoE block's router and experts live in the checkpoint: "mlp" (qwen3_moe) or
  // "block_sparse_moe" (mixtral).
  std::string MoeModule() const;
  // An expert projection's name (proj 0 gate, 1 up, 2 down): gate_proj, up_proj, down_proj
  // (qwen3_moe) or w1, w3, w2 (mixtral).
  const char* ExpertProjName(int proj) const;
  // "{MoeModule}.experts.{expert}.{ExpertProjName}" (without ".weight").
  std::string ExpertModule(int64_t expert, int proj) const;

  // The tensors of block `i` as (name relative to "model.layers.{i}.", shape), in the
  // canonical order in which the store packs them.
  std::vector<std::pair<std::string, std::vector<int64_t>>> BlockTensorShapes() const;
  // The non-block tensors (full names) with their shapes; lm_head only when not tied.
  std::vector<std::pair<std::string, std::vector<int64_t>>> RestTensorShapes() const;
};

// Parses config.json text; throws Error(kCorrupt/kUnsupported) naming `source` and the field.
ModelConfig ParseModelConfig(const std::string& json_text, const std::string& source);
ModelConfig LoadModelConfig(const std::string& config_json_path);
void ToJson(nlohmann::json& out, const ModelConfig& config);  // the same keys as config.json
ModelConfig ModelConfigFromJson(const nlohmann::json& in, const std::string& source);

}  // namespace lorastream
