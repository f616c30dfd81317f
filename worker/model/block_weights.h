// One block's base weights as tensor views (BlockWeights) and how a segment's packed bytes
// become them: the one form every provider (resident, streamed; worker/model/block_provider.h)
// hands the model.
#pragma once

#include <array>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/formats/manifest.h"

namespace lorastream::worker {

// Views of one block's base weights (never requiring grad). Optional tensors are undefined
// when the architecture has none (biases: qwen2; q_norm/k_norm: qwen3). A block of a family
// whose blocks are not an LLM's (a FLUX.1 streaming unit: one double-stream block or a few
// single-stream ones) has every tensor in `named`, under its name in the segment, and no
// field above; an LLM block has `named` empty.
// A mixture of experts (qwen3_moe, mixtral) has no gate_proj/up_proj/down_proj but its router
// [num_experts, hidden] and, per expert, its gate, up and down weights.
struct BlockWeights {
  at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj;
  at::Tensor q_bias, k_bias, v_bias, q_norm, k_norm;
  at::Tensor post_norm, gate_proj, up_proj, down_proj;
  at::Tensor router;
  std::vector<std::array<at::Tensor, 3>> experts;  // [e] = {gate, up, down}
  std::map<std::string, at::Tensor> named;

  // Every tensor slot (fields, experts, then `named`), defined or not.
  template <class Fn>
  void ForEachSlot(Fn fn) {
    for (at::Tensor* t :
         {&input_norm, &q_proj, &k_proj, &v_proj, &o_proj, &q_bias, &k_bias, &v_bias, &q_norm,
          &k_norm, &post_norm, &gate_proj, &up_proj, &down_proj, &router})
      fn(*t);
    for (auto& e : experts)
      for (at::Tensor& t : e) fn(t);
    for (auto& [name, t] : named) fn(t);
  }
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

// The field holding the tensor of block-relative name `name` ("self_attn.q_proj.weight",
// "mlp.gate.weight", "mlp.experts.3.up_proj.weight", "block_sparse_moe.experts.0.w1.weight"),
// or nullptr when BlockWeights has none of that name. The non-const one makes room for an
// expert beyond `experts`; the const one returns nullptr for it.
at::Tensor* BlockWeightField(BlockWeights& weights, const std::string& name);
const at::Tensor* BlockWeightField(const BlockWeights& weights, const std::string& name);
// Where the tensor `name` of a segment goes under `naming`: its LLM field (nullptr when there
// is none of that name), or its entry of `named` (created when absent).
at::Tensor* BlockWeightSlot(BlockWeights& weights, const std::string& name, BlockNaming naming);

}  // namespace lorastream::worker
