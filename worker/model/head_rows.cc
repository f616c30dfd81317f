#include "worker/model/head_rows.h"

#include <algorithm>

namespace lorastream::worker {

uint64_t HeadChunkRowBytes(int64_t vocab, int64_t hidden, bool fused_cross_entropy) {
  const uint64_t v = static_cast<uint64_t>(std::max<int64_t>(vocab, 0));
  return (fused_cross_entropy ? 2 * v + 4 : 8 * v) +
         16 * static_cast<uint64_t>(std::max<int64_t>(hidden, 0));
}

int64_t HeadChunkRows(int64_t tokens, int64_t vocab, int64_t hidden, uint64_t bound_bytes,
                      bool fused_cross_entropy) {
  const uint64_t per_row =
      std::max<uint64_t>(1, HeadChunkRowBytes(vocab, hidden, fused_cross_entropy));
  const uint64_t rows = std::max<uint64_t>(1, bound_bytes / per_row);
  return static_cast<int64_t>(
      std::min<uint64_t>(rows, static_cast<uint64_t>(std::max<int64_t>(tokens, 1))));
}

int64_t HeadSliceRows(int64_t vocab, int64_t hidden, const QuantInfo& quant, uint64_t slice_bytes) {
  const int64_t align = QuantRowAlignment(quant, hidden);
  const int64_t fit =
      static_cast<int64_t>(slice_bytes / (2 * static_cast<uint64_t>(std::max<int64_t>(hidden, 1))));
  return std::min(std::max<int64_t>(vocab, 1), std::max(align, fit / align * align));
}

}  // namespace lorastream::worker
