// One block's base weights as tensor views (BlockWeights) and how a segment's packed bytes
// become them: the one form every provider (resident, streamed; worker/model/block_provider.h)
// hands the model.
#pragma once

#include <map>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/manifest.h"

namespace lorastream::worker {

// Views of one block's base weights (never requiring grad). Optional tensors are undefined
// when the architecture has none (biases: qwen2; q_norm/k_norm: qwen3). A block of a family
// whose blocks are not an LLM's (a FLUX.1 streaming unit: one double-stream block or a few
// single-stream ones) has every tensor in `named`, under its name in the segment, and no
// field above; an LLM block has `named` empty.
struct BlockWeights {
  at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj;
  at::Tensor q_bias, k_bias, v_bias, q_norm, k_norm;
  at::Tensor post_norm, gate_proj, up_proj, down_proj;
  std::map<std::string, at::Tensor> named;
};

// Where a segment's tensors go in BlockWeights: an LLM block's into the fields (a tensor
// without one is refused as corrupt), any other family's into `named`.
enum class BlockNaming { kLlmFields, kByName };
// kByName for a FLUX manifest, kLlmFields for every LLM family.
BlockNaming BlockNamingOf(const Manifest& manifest);

// Views at the manifest's offsets over `bytes` (a uint8 tensor holding one block's packed
// bytes, on any device); no copy.
BlockWeights BlockWeightsFromBytes(const at::Tensor& bytes, const SegmentInfo& layout,
                                   BlockNaming naming = BlockNaming::kLlmFields);

// The field holding the tensor of block-relative name `name` ("self_attn.q_proj.weight"), or
// nullptr when BlockWeights has none of that name.
at::Tensor* BlockWeightField(BlockWeights& weights, const std::string& name);
const at::Tensor* BlockWeightField(const BlockWeights& weights, const std::string& name);
// Where the tensor `name` of a segment goes under `naming`: its LLM field (nullptr when there
// is none of that name), or its entry of `named` (created when absent).
at::Tensor* BlockWeightSlot(BlockWeights& weights, const std::string& name, BlockNaming naming);

}  // namespace lorastream::worker
