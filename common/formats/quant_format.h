// How a compressed weight lies in a store's segment (torch-free): the format description the
// manifest records, the auxiliary tensors (scales) each format stores beside the weight, and
// the checks a reader makes before trusting them. The arithmetic (quantising, expanding) is
// store/quantize.h's.
//
// A block's projection weights are compressed (an LLM block's q, k, v, o, gate, up and down; a
// FLUX.1 block's linear layers: common/formats/flux_config.h IsFluxBlockLinearWeight), and on
// request an LLM's LM head and embedding table of the rest segment (`--quantize-head`,
// `--quantize-embedding`); norms and biases stay in the store's floating dtype.
//
//   fp8  e4m3 (F8_E4M3) in the weight's own [out, in] shape, one F32 per block_rows x
//        block_cols tile in `<weight>_scale_inv` ([ceil(out/br), ceil(in/bc)]): w = q * s, as
//        the official FP8 checkpoints (quant_method "fp8", weight_block_size [128, 128]).
//   nf4  bitsandbytes' NF4: two 4-bit codes a byte (the first element in the high nibble), one
//        absmax per `blocksize` elements, itself quantised to 8 bits against a dynamic map in
//        groups of `nested_blocksize`, around an offset (the mean of every absmax):
//          absmax_b = nested_quant_map[absmax[b]] * nested_absmax[b / nested] + nested_offset
//          w_i      = quant_map[code_i] * absmax_{i / blocksize}
//        aux tensors `<weight>.absmax` (U8), `.nested_absmax`, `.quant_map` (16),
//        `.nested_quant_map` (256), `.nested_offset` (1), all F32 but the first.
// The weight slice keeps its logical shape ([out, in]); its dtype is the stored element type
// (F8_E4M3; U8 for nf4, whose nbytes is half its element count).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/base/dtype.h"

namespace lorastream {

struct SegmentInfo;
struct TensorSlice;

enum class QuantMethod : uint8_t { kNone, kFp8, kNf4 };

struct QuantInfo {
  QuantMethod method = QuantMethod::kNone;
  int64_t block_rows = 0, block_cols = 0;       // fp8: one scale per tile
  int64_t blocksize = 0, nested_blocksize = 0;  // nf4: elements per absmax, absmax per scale

  bool compressed() const { return method != QuantMethod::kNone; }
  bool operator==(const QuantInfo& o) const {
    return method == o.method && block_rows == o.block_rows && block_cols == o.block_cols &&
           blocksize == o.blocksize && nested_blocksize == o.nested_blocksize;
  }
};

// "none" | "fp8" | "nf4" and back (nullopt for anything else).
const char* QuantMethodName(QuantMethod method);
std::optional<QuantMethod> ParseQuantMethod(const std::string& name);
// "fp8 (e4m3, 128x128 scales)", "nf4 (64-value blocks, double-quantised in 256)", "bf16".
std::string DescribeQuant(const QuantInfo& quant);

// The store's own formats for `--quantize`: fp8 with 128x128 tiles; nf4 with bitsandbytes'
// defaults (blocks of 64, absmax in groups of 256).
QuantInfo StoreQuantFormat(QuantMethod method);

// True for the names of the projection weights a store may compress: an LLM block's,
// block-relative ("self_attn.q_proj.weight"), and a FLUX.1 unit's, by full BFL name
// ("double_blocks.0.img_mlp.0.weight": a FLUX segment names its tensors so).
bool IsProjectionWeight(const std::string& name);

// True for the full names of the weights outside the blocks a store may compress on request:
// lm_head.weight and model.embed_tokens.weight (a tied model's one table is the latter).
bool IsCompressibleRestWeight(const std::string& name);

// The rows a slice of a compressed [rows, cols] weight must start at a multiple of to be a
// weight of the same format itself (its scales a contiguous part of the weight's): fp8's tile
// rows; for nf4 the rows whose elements fill whole groups of blocksize x nested_blocksize
// (one nested_absmax each). 1 for an uncompressed weight.
int64_t QuantRowAlignment(const QuantInfo& quant, int64_t cols);

// The stored element type and byte size of a weight of `shape` in `quant`.
DType QuantizedWeightDType(const QuantInfo& quant);
uint64_t QuantizedWeightBytes(const std::vector<int64_t>& shape, const QuantInfo& quant);

struct QuantAuxTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
// The auxiliary tensors of compressed weight `weight` of `shape`, in the order a segment holds
// them (right after the weight); their names are the weight's with the format's suffixes.
std::vector<QuantAuxTensor> QuantAuxTensors(const std::string& weight,
                                            const std::vector<int64_t>& shape,
                                            const QuantInfo& quant);

// "" when every compressed weight of `segment` is a 2-D weight of a valid format with each of
// its auxiliary tensors present, of the right dtype and shape, and one that may be compressed
// there (a block's projection weight; in the rest segment, `rest_segment`, the LM head or the
// embedding table); else what is wrong, naming the tensor ("tensor
// `self_attn.q_proj.weight_scale_inv` has shape ...").
std::string QuantLayoutProblem(const SegmentInfo& segment, bool rest_segment = false);

// Bytes from compressed weight `weight`'s offset in `segment` to the end of its last auxiliary
// tensor: the one contiguous range that holds it compressed (LayoutSegment places the scales
// right after their weight).
uint64_t CompressedSpanBytes(const SegmentInfo& segment, const TensorSlice& weight);

// Elements of every compressed weight of `segment`: what expanding the block produces.
int64_t ExpandedElements(const SegmentInfo& segment);

// The format of a store: the one format of its compressed weights (none when it has none).
QuantInfo SegmentQuant(const SegmentInfo& segment);

}  // namespace lorastream
