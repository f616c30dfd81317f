#include "worker/model/quant_expand.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/base/error.h"
#include "store/quantize.h"
#ifdef LORASTREAM_HAVE_CUDA
#include <c10/cuda/CUDAStream.h>

#include "worker/model/cuda/quant_kernels.h"
#endif

namespace lorastream::worker {

namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The slice `name` of `layout` (QuantLayoutProblem has vouched for it).
const TensorSlice& Slice(const SegmentInfo& layout, const std::string& name) {
  const TensorSlice* s = layout.Find(name);
  LS_CHECK(s != nullptr, "compressed block without `" + name + "`");
  return *s;
}

// Expands `w` of `layout` over `bytes` into `out` (bf16, Numel(w.shape) elements, on the
// same device).
void ExpandInto(const at::Tensor& bytes, const SegmentInfo& layout, const TensorSlice& w,
                uint16_t* out) {
  const uint8_t* base = bytes.data_ptr<uint8_t>();
  auto aux = [&](const std::string& suffix) {
    return base + Slice(layout, w.name + suffix).offset;
  };
  auto f32 = [&](const std::string& suffix) { return reinterpret_cast<const float*>(aux(suffix)); };
  const int64_t n = Numel(w.shape);
  if (w.quant.method == QuantMethod::kFp8) {
    if (bytes.is_cuda()) {
#ifdef LORASTREAM_HAVE_CUDA
      cuda::ExpandFp8(base + w.offset, f32("_scale_inv"), w.shape[0], w.shape[1],
                      w.quant.block_rows, w.quant.block_cols, out,
                      c10::cuda::getCurrentCUDAStream(bytes.device().index()).stream());
      return;
#endif
    }
    const store::Fp8Weight fw{base + w.offset, f32("_scale_inv"),  w.shape[0],
                              w.shape[1],      w.quant.block_rows, w.quant.block_cols};
    at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
      store::ExpandFp8(fw, begin, end, out + begin);
    });
    return;
  }
  LS_CHECK(w.quant.method == QuantMethod::kNf4, "unknown compressed format");
  if (bytes.is_cuda()) {
#ifdef LORASTREAM_HAVE_CUDA
    cuda::ExpandNf4(base + w.offset, aux(".absmax"), f32(".nested_absmax"), f32(".quant_map"),
                    f32(".nested_quant_map"), f32(".nested_offset"), n, w.quant.blocksize,
                    w.quant.nested_blocksize, out,
                    c10::cuda::getCurrentCUDAStream(bytes.device().index()).stream());
    return;
#endif
  }
  const store::Nf4Weight nw{base + w.offset,
                            aux(".absmax"),
                            f32(".nested_absmax"),
                            f32(".quant_map"),
                            f32(".nested_quant_map"),
                            *f32(".nested_offset"),
                            n,
                            w.quant.blocksize,
                            w.quant.nested_blocksize};
  // Ranges start on an even element (ExpandNf4 takes any, but pairs share a byte).
  at::parallel_for(0, (n + 1) / 2, 1 << 15, [&](int64_t begin, int64_t end) {
    store::ExpandNf4(nw, 2 * begin, std::min(n, 2 * end), out + 2 * begin);
  });
}

}  // namespace

bool HasCompressedWeights(const SegmentInfo& layout) { return SegmentQuant(layout).compressed(); }

void ExpandRowsInto(const at::Tensor& bytes, const SegmentInfo& layout, const TensorSlice& w,
                    int64_t row_begin, int64_t rows, uint16_t* out) {
  LS_CHECK(w.quant.compressed() && w.shape.size() == 2, "ExpandRowsInto of a plain tensor");
  const int64_t cols = w.shape[1];
  LS_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= w.shape[0] &&
               row_begin % QuantRowAlignment(w.quant, cols) == 0,
           "rows of `" + w.name + "` that do not start a tile or an absmax group");
  // The rows as a weight of their own: its bytes and scales are contiguous parts of the
  // whole weight's (the maps and offset of nf4 are shared).
  const int64_t first = row_begin * cols;
  TensorSlice part = w;
  part.shape = {rows, cols};
  SegmentInfo sub;
  auto shifted = [&](const std::string& suffix, uint64_t by) {
    TensorSlice s = Slice(layout, w.name + suffix);
    s.offset += by;
    sub.tensors.push_back(std::move(s));
  };
  if (w.quant.method == QuantMethod::kFp8) {
    part.offset += static_cast<uint64_t>(first);
    const int64_t tiles = (cols + w.quant.block_cols - 1) / w.quant.block_cols;
    shifted("_scale_inv", static_cast<uint64_t>(row_begin / w.quant.block_rows * tiles) * 4);
  } else {
    part.offset += static_cast<uint64_t>(first / 2);
    shifted(".absmax", static_cast<uint64_t>(first / w.quant.blocksize));
    shifted(".nested_absmax",
            static_cast<uint64_t>(first / (w.quant.blocksize * w.quant.nested_blocksize)) * 4);
    for (const char* shared : {".quant_map", ".nested_quant_map", ".nested_offset"})
      shifted(shared, 0);
  }
  if (rows > 0) ExpandInto(bytes, sub, part, out);
}

at::Tensor ExpandWeight(const at::Tensor& bytes, const SegmentInfo& layout,
                        const TensorSlice& weight) {
  LS_CHECK(weight.quant.compressed(), "ExpandWeight of a plain tensor");
  at::Tensor out = at::empty(weight.shape, bytes.options().dtype(at::kBFloat16));
  ExpandInto(bytes, layout, weight, reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

BlockWeights PlainBlockWeights(const at::Tensor& bytes, const SegmentInfo& layout,
                               c10::ScalarType dtype, BlockNaming naming) {
  // Their own layout without the compressed weights and scales.
  SegmentInfo plain = layout;
  plain.tensors.clear();
  std::vector<std::string> aux;
  for (const TensorSlice& t : layout.tensors)
    if (t.quant.compressed())
      for (const QuantAuxTensor& a : QuantAuxTensors(t.name, t.shape, t.quant))
        aux.push_back(a.name);
  for (const TensorSlice& t : layout.tensors)
    if (!t.quant.compressed() && std::find(aux.begin(), aux.end(), t.name) == aux.end())
      plain.tensors.push_back(t);
  BlockWeights w = BlockWeightsFromBytes(bytes, plain, naming);
  for (const TensorSlice& t : plain.tensors) {
    at::Tensor* field = BlockWeightSlot(w, t.name, naming);
    if (field->scalar_type() != dtype) *field = field->to(dtype);
  }
  return w;
}

void ExpandProjections(const at::Tensor& bytes, const SegmentInfo& layout, c10::ScalarType dtype,
                       at::Tensor* buffer, BlockWeights* w, BlockNaming naming) {
  const int64_t total = ExpandedElements(layout);
  const auto options = bytes.options().dtype(dtype);
  if (!buffer->defined() || buffer->scalar_type() != dtype || buffer->device() != bytes.device() ||
      buffer->numel() < total)
    *buffer = at::empty({total}, options);
  // bf16 expands in place; another dtype through one bf16 weight at a time.
  at::Tensor staging;
  int64_t at_element = 0;
  for (const TensorSlice& t : layout.tensors) {
    if (!t.quant.compressed()) continue;
    const int64_t n = Numel(t.shape);
    at::Tensor dst = buffer->narrow(0, at_element, n);
    at_element += n;
    if (dtype == at::kBFloat16) {
      ExpandInto(bytes, layout, t, reinterpret_cast<uint16_t*>(dst.data_ptr()));
    } else {
      if (!staging.defined() || staging.numel() < n)
        staging = at::empty({n}, bytes.options().dtype(at::kBFloat16));
      ExpandInto(bytes, layout, t, reinterpret_cast<uint16_t*>(staging.data_ptr()));
      dst.copy_(staging.narrow(0, 0, n));
    }
    *BlockWeightSlot(*w, t.name, naming) = dst.view(t.shape);
  }
}

double MeasureBlockExpansion(const uint8_t* host_bytes, const SegmentInfo& layout,
                             c10::Device device, c10::ScalarType dtype, int reps,
                             BlockNaming naming) {
  const at::Tensor bytes =
      at::from_blob(const_cast<uint8_t*>(host_bytes), {static_cast<int64_t>(layout.nbytes)},
                    at::TensorOptions().dtype(at::kByte))
          .to(device);
  at::Tensor buffer;
  BlockWeights w = PlainBlockWeights(bytes, layout, dtype, naming);
  std::vector<double> seconds;
  for (int r = 0; r <= reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    ExpandProjections(bytes, layout, dtype, &buffer, &w, naming);
    (void)buffer.narrow(0, 0, 1).item<float>();  // waits for the device's queue
    if (r > 0)
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds.empty() ? 0.0 : seconds[seconds.size() / 2];
}

BlockWeights ExpandBlock(const at::Tensor& bytes, const SegmentInfo& layout, c10::ScalarType dtype,
                         at::Tensor* buffer, BlockNaming naming) {
  BlockWeights w = PlainBlockWeights(bytes, layout, dtype, naming);
  ExpandProjections(bytes, layout, dtype, buffer, &w, naming);
  return w;
}

}  // namespace lorastream::worker
