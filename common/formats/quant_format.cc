#include "common/formats/quant_format.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "common/formats/flux_config.h"
#include "common/formats/manifest.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/safetensors.h"

namespace lorastream {

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Tile and block sizes a reader accepts: positive and small enough that no index overflows.
bool ValidBlock(int64_t v) { return v > 0 && v <= (int64_t{1} << 20); }

}  // namespace

const char* QuantMethodName(QuantMethod method) {
  switch (method) {
    case QuantMethod::kFp8:
      return "fp8";
    case QuantMethod::kNf4:
      return "nf4";
    case QuantMethod::kNone:
      break;
  }
  return "none";
}

std::optional<QuantMethod> ParseQuantMethod(const std::string& name) {
  for (QuantMethod m : {QuantMethod::kNone, QuantMethod::kFp8, QuantMethod::kNf4})
    if (name == QuantMethodName(m)) return m;
  return std::nullopt;
}

std::string DescribeQuant(const QuantInfo& q) {
  switch (q.method) {
    case QuantMethod::kFp8:
      return "fp8 (e4m3, " + std::to_string(q.block_rows) + "x" + std::to_string(q.block_cols) +
             " scales)";
    case QuantMethod::kNf4:
      return "nf4 (" + std::to_string(q.blocksize) + "-value blocks, absmax double-quantised in " +
             std::to_string(q.nested_blocksize) + ")";
    case QuantMethod::kNone:
      break;
  }
  return "none";
}

QuantInfo StoreQuantFormat(QuantMethod method) {
  QuantInfo q;
  q.method = method;
  if (method == QuantMethod::kFp8) q.block_rows = q.block_cols = 128;
  if (method == QuantMethod::kNf4) {
    q.blocksize = 64;
    q.nested_blocksize = 256;
  }
  return q;
}

bool IsProjectionWeight(const std::string& name) {
  static const std::set<std::string> kNames = {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                               "mlp.gate_proj.weight",    "mlp.up_proj.weight",
                                               "mlp.down_proj.weight"};
  return kNames.count(name) > 0 || IsFluxBlockLinearWeight(name) ||
         IsQwenImageBlockLinearWeight(name);
}

bool IsCompressibleRestWeight(const std::string& name) {
  return name == "lm_head.weight" || name == "model.embed_tokens.weight";
}

int64_t QuantRowAlignment(const QuantInfo& q, int64_t cols) {
  if (q.method == QuantMethod::kFp8) return q.block_rows;
  if (q.method != QuantMethod::kNf4) return 1;
  const int64_t group = q.blocksize * q.nested_blocksize;
  return group / std::gcd(group, std::max<int64_t>(cols, 1));
}

DType QuantizedWeightDType(const QuantInfo& q) {
  return q.method == QuantMethod::kFp8 ? DType::kF8E4M3 : DType::kU8;
}

uint64_t QuantizedWeightBytes(const std::vector<int64_t>& shape, const QuantInfo& q) {
  const uint64_t n = static_cast<uint64_t>(Numel(shape));
  return q.method == QuantMethod::kNf4 ? (n + 1) / 2 : n;
}

std::vector<QuantAuxTensor> QuantAuxTensors(const std::string& weight,
                                            const std::vector<int64_t>& shape, const QuantInfo& q) {
  if (q.method == QuantMethod::kFp8) {
    return {{weight + "_scale_inv",
             DType::kF32,
             {CeilDiv(shape.at(0), q.block_rows), CeilDiv(shape.at(1), q.block_cols)}}};
  }
  if (q.method == QuantMethod::kNf4) {
    const int64_t blocks = CeilDiv(Numel(shape), q.blocksize);
    return {{weight + ".absmax", DType::kU8, {blocks}},
            {weight + ".nested_absmax", DType::kF32, {CeilDiv(blocks, q.nested_blocksize)}},
            {weight + ".quant_map", DType::kF32, {16}},
            {weight + ".nested_quant_map", DType::kF32, {256}},
            {weight + ".nested_offset", DType::kF32, {1}}};
  }
  return {};
}

std::string QuantLayoutProblem(const SegmentInfo& segment, bool rest_segment) {
  for (const TensorSlice& t : segment.tensors) {
    if (!t.quant.compressed()) continue;
    const std::string at = "tensor `" + t.name + "`";
    if (rest_segment ? !IsCompressibleRestWeight(t.name) : !IsProjectionWeight(t.name))
      return at + " is stored " + QuantMethodName(t.quant.method) +
             (rest_segment ? "; outside the blocks only the LM head and the embedding table may "
                             "be compressed"
                           : "; only the projection weights (q, k, v, o, gate, up, down; a FLUX "
                             "block's linear layers) may be compressed");
    if (t.shape.size() != 2) return at + " is compressed but not 2-D";
    if (t.quant.method == QuantMethod::kFp8 &&
        !(ValidBlock(t.quant.block_rows) && ValidBlock(t.quant.block_cols)))
      return at + ": fp8 tile " + std::to_string(t.quant.block_rows) + "x" +
             std::to_string(t.quant.block_cols) + " is not a valid weight_block_size";
    if (t.quant.method == QuantMethod::kNf4 &&
        !(ValidBlock(t.quant.blocksize) && t.quant.blocksize % 2 == 0 &&
          ValidBlock(t.quant.nested_blocksize)))
      return at + ": nf4 blocksize " + std::to_string(t.quant.blocksize) + " / nested " +
             std::to_string(t.quant.nested_blocksize) + " is not valid (even, positive)";
    if (t.dtype != QuantizedWeightDType(t.quant))
      return at + " is " + DTypeName(t.dtype) + " but " + QuantMethodName(t.quant.method) +
             " stores " + DTypeName(QuantizedWeightDType(t.quant));
    if (t.nbytes != QuantizedWeightBytes(t.shape, t.quant))
      return at + " holds " + std::to_string(t.nbytes) + " bytes but " + ShapeString(t.shape) +
             " in " + QuantMethodName(t.quant.method) + " needs " +
             std::to_string(QuantizedWeightBytes(t.shape, t.quant)) + " (truncated?)";
    for (const QuantAuxTensor& aux : QuantAuxTensors(t.name, t.shape, t.quant)) {
      const TensorSlice* s = segment.Find(aux.name);
      if (s == nullptr) return "tensor `" + aux.name + "` (a scale of `" + t.name + "`) is missing";
      if (s->dtype != aux.dtype || s->shape != aux.shape)
        return "tensor `" + aux.name + "` is " + DTypeName(s->dtype) + " " + ShapeString(s->shape) +
               " but `" + t.name + "` " + ShapeString(t.shape) + " in " + DescribeQuant(t.quant) +
               " needs " + DTypeName(aux.dtype) + " " + ShapeString(aux.shape);
    }
  }
  return "";
}

uint64_t CompressedSpanBytes(const SegmentInfo& segment, const TensorSlice& weight) {
  uint64_t end = weight.offset + weight.nbytes;
  for (const QuantAuxTensor& aux : QuantAuxTensors(weight.name, weight.shape, weight.quant))
    if (const TensorSlice* s = segment.Find(aux.name)) end = std::max(end, s->offset + s->nbytes);
  return end - weight.offset;
}

int64_t ExpandedElements(const SegmentInfo& segment) {
  int64_t n = 0;
  for (const TensorSlice& t : segment.tensors)
    if (t.quant.compressed()) n += Numel(t.shape);
  return n;
}

QuantInfo SegmentQuant(const SegmentInfo& segment) {
  for (const TensorSlice& t : segment.tensors)
    if (t.quant.compressed()) return t.quant;
  return {};
}

}  // namespace lorastream
