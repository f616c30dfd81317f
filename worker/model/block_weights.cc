// BlockWeightsFromBytes: tensor views at the manifest's offsets inside one block's bytes.
#include <ATen/ATen.h>

#include "common/base/error.h"
#include "worker/model/base_weights.h"
#include "worker/model/block_weights.h"

namespace lorastream::worker {

namespace {

// An expert's projection name ("mlp.experts.E.gate_proj.weight", mixtral's
// "block_sparse_moe.experts.E.w1.weight"): 0 gate, 1 up, 2 down and *expert, or -1.
int ParseExpertName(const std::string& name, int64_t* expert) {
  std::string rest;
  for (const char* prefix : {"mlp.experts.", "block_sparse_moe.experts."})
    if (name.rfind(prefix, 0) == 0) rest = name.substr(std::string(prefix).size());
  const size_t dot = rest.find('.');
  if (rest.empty() || dot == 0 || dot == std::string::npos || dot > 6) return -1;
  for (size_t i = 0; i < dot; ++i)
    if (rest[i] < '0' || rest[i] > '9') return -1;
  if (dot > 1 && rest[0] == '0') return -1;
  *expert = std::stoll(rest.substr(0, dot));
  const std::string proj = rest.substr(dot + 1);
  const bool mixtral = name[0] == 'b';
  static const char* kQwen[] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
  static const char* kMixtral[] = {"w1.weight", "w3.weight", "w2.weight"};
  for (int p = 0; p < 3; ++p)
    if (proj == (mixtral ? kMixtral : kQwen)[p]) return p;
  return -1;
}

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
  const int proj = ParseExpertName(name, &expert);
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
