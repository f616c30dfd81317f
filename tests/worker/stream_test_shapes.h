// The shapes the streaming planner's tests reason about, as memory-model inputs: the
// llama-3-8b block (the benchmark's 16-layer checkpoint) and the full Qwen3-8B (the
// smallest-GPU target: it trains at 2048 tokens within 5 GiB).
#pragma once

#include <cstdint>

#include "common/formats/model_config.h"
#include "worker/stream/stream_budget.h"

namespace lorastream::testing {

inline ModelConfig Llama3_8bShape(int layers) {
  ModelConfig c;
  c.model_type = "llama";
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.vocab_size = 128256;
  return c;
}

// Qwen3-8B: 36 blocks of 386 MB in bf16, a 151,936-token vocabulary, untied LM head.
inline ModelConfig Qwen3_8bShape() {
  ModelConfig c = Llama3_8bShape(36);  // the same attention shape
  c.model_type = "qwen3";
  c.intermediate_size = 12288;
  c.vocab_size = 151936;
  c.qk_norm = true;
  return c;
}

// Qwen3-30B-A3B: 48 blocks of 1.25 GB in bf16, each 128 experts of width 768 (8 per token)
// behind Qwen3's attention with 4 key-value heads.
inline ModelConfig Qwen3MoeShape(int layers) {
  ModelConfig c = Qwen3_8bShape();
  c.model_type = "qwen3_moe";
  c.num_hidden_layers = layers;
  c.hidden_size = 2048;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 768;
  return c;
}

// bf16 blocks sized from the config's shapes; the final norm and the LM head on the device,
// the embedding table in host RAM (SetNonBlockBytes).
inline worker::MemoryModelInputs InputsFor(const ModelConfig& config, int64_t tokens) {
  worker::MemoryModelInputs in;
  in.config = config;
  uint64_t block = 0;
  for (const auto& [name, shape] : in.config.BlockTensorShapes()) {
    uint64_t n = 2;
    for (int64_t d : shape) n *= d;
    block += n;
  }
  in.block_bytes.assign(config.num_hidden_layers, block);
  in.tokens = tokens;
  in.compute_bytes = 2;
  worker::SetNonBlockBytes(&in);
  return in;
}

inline worker::MemoryModelInputs Inputs(int layers, int64_t tokens) {
  return InputsFor(Llama3_8bShape(layers), tokens);
}

}  // namespace lorastream::testing
