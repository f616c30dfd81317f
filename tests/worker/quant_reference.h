// A plain reference dequantisation of the store's formats in f32 ATen ops, rounded once to
// bf16 (common/formats/quant_format.h's definitions, the store's 128x128 tiles and 64/256 nf4
// blocks), that the worker's expansions are tested against bit for bit.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "common/formats/manifest.h"

namespace lorastream::testing {

inline at::Tensor SliceOf(const at::Tensor& bytes, const SegmentInfo& layout,
                          const std::string& name, at::ScalarType type) {
  const TensorSlice* s = layout.Find(name);
  if (s == nullptr) throw std::runtime_error("no tensor `" + name + "` in the layout");
  return bytes.narrow(0, static_cast<int64_t>(s->offset), static_cast<int64_t>(s->nbytes))
      .view(type);
}

// The reference: each format's definition in f32 ATen ops, rounded once to bf16.
inline at::Tensor ReferenceDequant(const at::Tensor& bytes, const SegmentInfo& layout,
                                   const TensorSlice& w) {
  const int64_t rows = w.shape[0], cols = w.shape[1];
  if (w.quant.method == QuantMethod::kFp8) {
    // e4m3 by its definition: sign, 4-bit exponent (bias 7), 3-bit mantissa; a table of the
    // 256 codes (NaN never occurs in a finite store).
    std::vector<float> table(256);
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
      table[b] = static_cast<float>(b & 128 ? -v : v);
    }
    const at::Tensor q = SliceOf(bytes, layout, w.name, at::kByte).to(at::kLong);
    const at::Tensor v =
        at::from_blob(table.data(), {256}, at::kFloat).index({q}).view({rows, cols});
    const at::Tensor s = SliceOf(bytes, layout, w.name + "_scale_inv", at::kFloat)
                             .view({(rows + 127) / 128, (cols + 127) / 128})
                             .repeat_interleave(128, 0)
                             .repeat_interleave(128, 1)
                             .narrow(0, 0, rows)
                             .narrow(1, 0, cols);
    return (v * s).to(at::kBFloat16);
  }
  const at::Tensor packed = SliceOf(bytes, layout, w.name, at::kByte).to(at::kLong);
  const at::Tensor codes = at::stack({packed.__rshift__(4), packed.bitwise_and(15)}, 1).view(-1);
  const at::Tensor qmap = SliceOf(bytes, layout, w.name + ".quant_map", at::kFloat);
  const at::Tensor nmap = SliceOf(bytes, layout, w.name + ".nested_quant_map", at::kFloat);
  const at::Tensor qabs = SliceOf(bytes, layout, w.name + ".absmax", at::kByte).to(at::kLong);
  const at::Tensor nabs = SliceOf(bytes, layout, w.name + ".nested_absmax", at::kFloat);
  const float offset = SliceOf(bytes, layout, w.name + ".nested_offset", at::kFloat).item<float>();
  const int64_t blocks = qabs.numel();
  const at::Tensor absmax =
      nmap.index({qabs}) * nabs.repeat_interleave(256).narrow(0, 0, blocks) + offset;
  const at::Tensor a = absmax.repeat_interleave(64).narrow(0, 0, rows * cols);
  return (qmap.index({codes}) * a).to(at::kBFloat16).view({rows, cols});
}

}  // namespace lorastream::testing
