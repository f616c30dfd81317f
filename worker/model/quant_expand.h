// A compressed block's weights as the model computes with them (common/formats/quant_format.h): the
// projection weights expanded from the copied compressed bytes into a buffer on the same
// device (the CPU with store/quantize.h's arithmetic, a GPU with
// worker/model/cuda/quant_kernels.cu, which equal it bit for bit), the other tensors viewed in
// place.
//
// The expanded weight is the bf16 value the format's reference dequantisation gives; in an
// f32 computation it is that bf16 value widened, so the CPU's f32 runs and a GPU's bf16 runs
// compute with the same weights.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/manifest.h"
#include "worker/model/block_weights.h"

namespace lorastream::worker {

// True when `layout` holds a compressed weight.
bool HasCompressedWeights(const SegmentInfo& layout);

// The block's weights over `bytes` (its packed bytes, on any device): each compressed
// projection expanded into `*buffer` (reused when it is large enough and of `dtype` on that
// device, else allocated), every other tensor a view of `bytes`, converted to `dtype` when it
// is stored otherwise. On a GPU the expansion is enqueued on the current stream. The layout
// must be one a manifest reader accepted (QuantLayoutProblem empty). `naming` says where each
// tensor goes (block_weights.h): an LLM block's fields, or a FLUX unit's `named` entries
// under the segment's names, the expanded projections included.
BlockWeights ExpandBlock(const at::Tensor& bytes, const SegmentInfo& layout, c10::ScalarType dtype,
                         at::Tensor* buffer, BlockNaming naming = BlockNaming::kLlmFields);

// The two halves of ExpandBlock, for a block kept compressed on the device and expanded per
// use (worker/stream/stream_engine.h): its plain tensors (views of `bytes`, converted to
// `dtype` when stored otherwise: done once), the compressed projections left undefined; then,
// per use, the projections expanded into `*buffer` (as ExpandBlock) and set in `*weights`.
BlockWeights PlainBlockWeights(const at::Tensor& bytes, const SegmentInfo& layout,
                               c10::ScalarType dtype, BlockNaming naming = BlockNaming::kLlmFields);
void ExpandProjections(const at::Tensor& bytes, const SegmentInfo& layout, c10::ScalarType dtype,
                       at::Tensor* buffer, BlockWeights* weights,
                       BlockNaming naming = BlockNaming::kLlmFields);

// Seconds to expand the compressed projections of a block of `layout` (its packed bytes at
// `host_bytes`, copied to `device` once) into `dtype` on `device`: the median of `reps` after
// a warm-up. Each use of a compressed block costs one (the cost model's figure).
double MeasureBlockExpansion(const uint8_t* host_bytes, const SegmentInfo& layout,
                             c10::Device device, c10::ScalarType dtype, int reps = 5,
                             BlockNaming naming = BlockNaming::kLlmFields);

// Rows [row_begin, row_begin + rows) of compressed weight `weight` of `layout` (over `bytes`,
// on any device) expanded into `out` (bf16, rows x cols, on that device; a GPU's enqueued on
// the current stream): the same kernels over offset pointers, so each element is the one the
// whole weight's expansion gives. row_begin must be a multiple of QuantRowAlignment.
void ExpandRowsInto(const at::Tensor& bytes, const SegmentInfo& layout, const TensorSlice& weight,
                    int64_t row_begin, int64_t rows, uint16_t* out);

// The expansion of a single compressed weight `weight` of `layout` into a new bf16 tensor
// (its logical shape) on the device of `bytes`.
at::Tensor ExpandWeight(const at::Tensor& bytes, const SegmentInfo& layout,
                        const TensorSlice& weight);

}  // namespace lorastream::worker
