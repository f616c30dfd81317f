// How the LM head is cut (torch-free): rows per chunk of the chunked head and loss
// (worker/model/chunked_head.cc), rows per vocabulary slice of a compressed head
// (worker/model/lm_head.h). The model computes in these pieces and the memory model
// (worker/stream/stream_budget.h) counts them.
#pragma once

#include <cstdint>

#include "common/formats/quant_format.h"

namespace lorastream::worker {

// The default bound on one chunk of the chunked LM head and loss: 256 MiB (a few hundred rows
// of a 150k vocabulary; each chunk's matmul is still large enough to run at full speed).
inline constexpr uint64_t kDefaultHeadChunkBytes = uint64_t{256} << 20;

// Bytes one row of a chunk of the chunked head holds at its peak: its logits and
// log-probabilities in f32 (8 V) and the final norm's saved tensors (16 H); with the fused
// cross entropy (worker/model/fused_ops.h: CUDA, bf16 or f16) its logits in the compute dtype,
// which their gradient overwrites, and its loss (2 V + 4) instead of the f32 pair.
uint64_t HeadChunkRowBytes(int64_t vocab, int64_t hidden, bool fused_cross_entropy = false);
// Rows per chunk: as many as fit `bound_bytes` (at least 1, at most `tokens`).
int64_t HeadChunkRows(int64_t tokens, int64_t vocab, int64_t hidden, uint64_t bound_bytes,
                      bool fused_cross_entropy = false);

// The default bound on one vocabulary slice of a compressed LM head, expanded: 32 MiB of bf16
// rows (4096 rows of a 4096-wide head; tens of slices of a 150k vocabulary).
inline constexpr uint64_t kHeadSliceBytes = uint64_t{32} << 20;
// Rows of one slice of a compressed LM head [vocab, hidden] in `quant`: as many as
// `slice_bytes` of bf16 rows hold, a multiple of QuantRowAlignment (at least one), at most
// vocab.
int64_t HeadSliceRows(int64_t vocab, int64_t hidden, const QuantInfo& quant,
                      uint64_t slice_bytes = kHeadSliceBytes);

}  // namespace lorastream::worker
