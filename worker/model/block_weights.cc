// BlockWeightsFromBytes: tensor views at the manifest's offsets inside one block's bytes.
#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/formats/expert_names.h"
#include "worker/model/base_weights.h"
#include "worker/model/block_weights.h"

namespace lorastream::worker {

namespace {

at::Tensor* Field(BlockWeights& w, const std::string& name, bool grow) {
  static const std::pair<const char*, at::Tensor BlockWeights::*> kFields[] = {
      {"input_layernorm.weight", &BlockWeights::input_norm},
      {"self_attn.q_proj.weight", &BlockWeights::q_proj},
      {"self_attn.k_proj.weight", &BlockWeights::k_proj},
      {"self_attn.v_proj.weight", &BlockWeights::v_proj},
      {"self_attn.o_proj.weight", &BlockWeights::o_proj},
      {"self_attn.q_proj.bias", &BlockWeights::q_bias},
      {"self_attn.k_proj.bias", &BlockWeights::k_bias},
      {"self_attn.v_proj.bias", &BlockWeights::v_bias},
      {"self_attn.q_norm.weight", &BlockWeights::q_norm},
      {"self_attn.k_norm.weight", &BlockWeights::k_norm},
      {"post_attention_layernorm.weight", &BlockWeights::post_norm},
      {"mlp.gate_proj.weight", &BlockWeights::gate_proj},
      {"mlp.up_proj.weight", &BlockWeights::up_proj},
      {"mlp.down_proj.weight", &BlockWeights::down_proj},
  };
  for (const auto& [n, field] : kFields)
    if (name == n) return &(w.*field);
  if (name == "mlp.gate.weight" || name == "block_sparse_moe.gate.weight") return &w.router;
  int64_t expert = 0;
  const int proj = ExpertProjectionOf(name, &expert);
  if (proj < 0) return nullptr;
  if (static_cast<size_t>(expert) >= w.experts.size()) {
    if (!grow) return nullptr;
    w.experts.resize(static_cast<size_t>(expert) + 1);
  }
  return &w.experts[static_cast<size_t>(expert)][static_cast<size_t>(proj)];
}

}  // namespace

at::Tensor* BlockWeightField(BlockWeights& w, const std::string& name) {
  return Field(w, name, /*grow=*/true);
}

const at::Tensor* BlockWeightField(const BlockWeights& w, const std::string& name) {
  return Field(const_cast<BlockWeights&>(w), name, /*grow=*/false);
}

at::Tensor* BlockWeightSlot(BlockWeights& w, const std::string& name, BlockNaming naming) {
  return naming == BlockNaming::kByName ? &w.named[name] : BlockWeightField(w, name);
}

BlockNaming BlockNamingOf(const Manifest& manifest) {
  return manifest.is_diffusion() ? BlockNaming::kByName : BlockNaming::kLlmFields;
}

BlockWeights BlockWeightsFromBytes(const at::Tensor& bytes, const SegmentInfo& layout,
                                   BlockNaming naming) {
  if (bytes.scalar_type() != at::kByte || bytes.dim() != 1 || !bytes.is_contiguous())
    throw Error(ErrorCode::kInvalidArgument,
                "BlockWeightsFromBytes: `bytes` must be a contiguous 1-D uint8 tensor");
  if (static_cast<uint64_t>(bytes.numel()) < layout.nbytes)
    throw Error(ErrorCode::kInvalidArgument,
                "BlockWeightsFromBytes: " + std::to_string(bytes.numel()) +
                    " bytes given for segment " + layout.shm_name + " of " +
                    std::to_string(layout.nbytes) + " bytes");
  BlockWeights w;
  for (const auto& t : layout.tensors) {
    at::Tensor* field = BlockWeightSlot(w, t.name, naming);
    if (field == nullptr)
      throw Error(ErrorCode::kCorrupt,
                  "segment " + layout.shm_name + ": unexpected tensor `" + t.name + "` in a block");
    const auto type = ScalarTypeOf(t.dtype, t.name);
    const uint64_t elem = DTypeSize(t.dtype);
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    if (t.offset + t.nbytes > static_cast<uint64_t>(bytes.numel()) || numel * elem != t.nbytes ||
        t.offset % elem != 0)
      throw Error(ErrorCode::kCorrupt, "segment " + layout.shm_name + ": tensor `" + t.name +
                                           "` does not fit its slice");
    *field = bytes.narrow(0, static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes))
                 .view(type)
                 .view(t.shape);
  }
  return w;
}

}  // namespace lorastream::worker
