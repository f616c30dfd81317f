// Expansion of compressed weights on the device (worker/model/cuda/quant_kernels.cu), on raw
// pointers: no LibTorch in the CUDA translation unit. The arithmetic is store/quantize.h's,
// rounded where it rounds (each product and sum alone, never fused), so a GPU's bf16 weights
// equal the CPU path's bit for bit; worker/model/quant_expand.cc wraps them for tensors.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace lorastream::worker::cuda {

// out[i] = bf16(e4m3(q[i]) * scale_inv[tile of i]) for the [rows, cols] weight.
void ExpandFp8(const uint8_t* q, const float* scale_inv, int64_t rows, int64_t cols,
               int64_t block_rows, int64_t block_cols, uint16_t* out, cudaStream_t stream);

// out[i] = bf16(quant_map[code_i] * absmax_b), absmax_b = f32(nested_quant_map[absmax[b]] *
// nested_absmax[b / nested]) + *nested_offset, for `numel` elements.
void ExpandNf4(const uint8_t* packed, const uint8_t* absmax, const float* nested_absmax,
               const float* quant_map, const float* nested_quant_map, const float* nested_offset,
               int64_t numel, int64_t blocksize, int64_t nested_blocksize, uint16_t* out,
               cudaStream_t stream);

}  // namespace lorastream::worker::cuda
