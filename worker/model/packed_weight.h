// A weight outside the blocks that a store keeps compressed (`lorastream-store serve
// --quantize fp8|nf4 --quantize-head / --quantize-embedding`): the LM head, expanded per
// vocabulary slice on the device that computes it (worker/model/lm_head.h), and the
// embedding table, whose batch rows are expanded on the host (a tied model's one table is
// both). The expansion is common/formats/quant_format.h's, exactly as a block's.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/manifest.h"

namespace lorastream::worker {

struct PackedWeight {
  // The weight's packed bytes and its scales: one contiguous range of the store's rest
  // segment (uint8, host, read-only), whose view keeps the store attached.
  at::Tensor bytes;
  // The weight (tensors.front(): its logical [rows, cols] shape and format) and its
  // auxiliary tensors, offsets relative to `bytes`.
  SegmentInfo layout;

  bool defined() const { return bytes.defined(); }
  const TensorSlice& weight() const { return layout.tensors.front(); }
  int64_t rows() const { return weight().shape.at(0); }
  int64_t cols() const { return weight().shape.at(1); }
};

// Compressed weight `name` of segment `layout` whose bytes `segment` (uint8) holds: a view of
// its range. The layout must be one a manifest reader accepted.
PackedWeight PackedWeightOf(const at::Tensor& segment, const SegmentInfo& layout,
                            const std::string& name);

// Rows [row_begin, row_begin + rows) of `w` expanded into `out` (rows x cols, contiguous, of
// any floating dtype: bf16 written directly, another through `*staging`, a bf16 buffer kept
// for reuse), from `bytes`, w.bytes or a copy of them on out's device. row_begin must be a
// multiple of QuantRowAlignment(w's format, cols).
void ExpandPackedRows(const PackedWeight& w, const at::Tensor& bytes, int64_t row_begin,
                      int64_t rows, at::Tensor& out, at::Tensor* staging);

// The rows `ids` (int64, any shape, host) of table `w` expanded on the host: [ids..., cols]
// in bf16 (what at::embedding of the expanded table gives, without expanding the rest).
// Refuses an id outside the table.
at::Tensor GatherPackedRows(const PackedWeight& w, const at::Tensor& ids);

}  // namespace lorastream::worker
