#include "worker/model/packed_weight.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/base/error.h"
#include "store/dequantize.h"
#include "worker/model/quant_expand.h"

namespace lorastream::worker {

PackedWeight PackedWeightOf(const at::Tensor& segment, const SegmentInfo& layout,
                            const std::string& name) {
  const TensorSlice* w = layout.Find(name);
  LS_CHECK(w != nullptr && w->quant.compressed() && w->shape.size() == 2,
           "`" + name + "` is not a compressed weight of its segment");
  PackedWeight p;
  p.layout.tensors.push_back(*w);
  for (const QuantAuxTensor& aux : QuantAuxTensors(w->name, w->shape, w->quant)) {
    const TensorSlice* s = layout.Find(aux.name);
    LS_CHECK(s != nullptr, "compressed `" + name + "` without `" + aux.name + "`");
    p.layout.tensors.push_back(*s);
  }
  // Rebased to the weight's offset (aligned, so every scale keeps its alignment); the
  // auxiliary tensors follow the weight (LayoutSegment).
  for (TensorSlice& t : p.layout.tensors) {
    LS_CHECK(t.offset >= w->offset, "a scale of `" + name + "` lies before it");
    t.offset -= w->offset;
  }
  p.layout.nbytes = CompressedSpanBytes(layout, *w);
  p.bytes =
      segment.narrow(0, static_cast<int64_t>(w->offset), static_cast<int64_t>(p.layout.nbytes));
  return p;
}

void ExpandPackedRows(const PackedWeight& w, const at::Tensor& bytes, int64_t row_begin,
                      int64_t rows, at::Tensor& out, at::Tensor* staging) {
  LS_CHECK(out.is_contiguous() && out.numel() == rows * w.cols() && out.device() == bytes.device(),
           "a packed weight's rows expand into a contiguous rows x cols tensor on its device");
  if (out.scalar_type() == at::kBFloat16) {
    ExpandRowsInto(bytes, w.layout, w.weight(), row_begin, rows,
                   reinterpret_cast<uint16_t*>(out.data_ptr()));
    return;
  }
  if (!staging->defined() || staging->numel() < out.numel() || staging->device() != out.device() ||
      staging->scalar_type() != at::kBFloat16)
    *staging = at::empty({out.numel()}, out.options().dtype(at::kBFloat16));
  ExpandRowsInto(bytes, w.layout, w.weight(), row_begin, rows,
                 reinterpret_cast<uint16_t*>(staging->data_ptr()));
  out.view({-1}).copy_(staging->narrow(0, 0, out.numel()));
}

at::Tensor GatherPackedRows(const PackedWeight& w, const at::Tensor& ids) {
  const at::Tensor flat = ids.to(at::kCPU, at::kLong).contiguous().view({-1});
  const int64_t n = flat.numel(), cols = w.cols(), rows = w.rows();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k)
    if (id[k] < 0 || id[k] >= rows)
      throw Error(ErrorCode::kInvalidArgument, "token id " + std::to_string(id[k]) +
                                                   " is outside the embedding table of " +
                                                   std::to_string(rows) + " rows");
  at::Tensor out = at::empty({n, cols}, at::TensorOptions().dtype(at::kBFloat16));
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint8_t* src = w.bytes.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      store::ExpandElements(src, w.layout, w.weight(), id[k] * cols, (id[k] + 1) * cols,
                            dst + k * cols);
  });
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(cols);
  return out.view(shape);
}

}  // namespace lorastream::worker
