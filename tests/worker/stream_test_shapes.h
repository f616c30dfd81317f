// The llama-3-8b block shape the streaming planner's tests reason about (the benchmark's
// 16-layer checkpoint), as memory-model inputs: bf16 blocks sized from the shapes.
#pragma once

#include <cstdint>

#include "common/model_config.h"
#include "worker/stream_budget.h"

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

inline MemoryModelInputs Inputs(int layers, int64_t tokens) {
  MemoryModelInputs in;
  in.config = Llama3_8bShape(layers);
  // bf16 block: 2 x (4 x 4096 x 4096 / 4 x ... ) computed from the shapes.
  uint64_t block = 0;
  for (const auto& [name, shape] : in.config.BlockTensorShapes()) {
    uint64_t n = 2;
    for (int64_t d : shape) n *= d;
    block += n;
  }
  in.block_bytes.assign(layers, block);
  in.rest_bytes = 2ULL * 2 * 128256 * 4096 + 2 * 4096;
  in.tokens = tokens;
  in.compute_bytes = 2;
  return in;
}

}  // namespace lorastream::testing
