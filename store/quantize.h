// The arithmetic of the compressed formats (common/formats/quant_format.h), torch-free: quantising
// a weight as `lorastream-store serve --quantize` does, and expanding it back to the bf16 weights a
// block computes with (the worker's CPU path; its CUDA kernels do the same arithmetic and are
// tested against this).
//
// The expanded value is defined as the f32 product rounded once to bf16 (nearest, ties to
// even), as the official fp8 and bitsandbytes dequantisations compute it:
//   fp8  bf16(e4m3(q) * scale_inv[tile])
//   nf4  bf16(quant_map[code] * absmax_b),
//        absmax_b = f32(nested_quant_map[absmax[b]] * nested_absmax[b / nested]) + nested_offset
// (two roundings in the absmax, never a fused multiply-add).
#pragma once

#include <array>
#include <cstdint>

namespace lorastream::store {

// e4m3fn (F8_E4M3): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity, NaN = S.1111.111.
float E4M3ToFloat(uint8_t bits);
// Round to nearest, ties to even, saturating at +-448; NaN -> 0x7f.
uint8_t FloatToE4M3(float value);

// bitsandbytes' NF4 code (get_4bit_type("nf4")) and its signed 8-bit dynamic map
// (create_dynamic_map(signed=True), the map of the double-quantised absmax).
extern const std::array<float, 16> kNf4Code;
const std::array<float, 256>& DynamicMap8Bit();

constexpr float kE4M3Max = 448.0f;

// Quantises rows [0, rows) of a band of a [rows_total, cols] weight (band = the rows of one
// tile row, rows <= block_rows) to e4m3: q (rows x cols) and one scale_inv per tile
// (ceil(cols / block_cols)): scale = amax / 448 (1 for an all-zero tile).
void QuantizeFp8Band(const float* band, int64_t rows, int64_t cols, int64_t block_cols, uint8_t* q,
                     float* scale_inv);

// Quantises `count` values (even; a multiple of blocksize but for the last block) to NF4:
// packed codes (count / 2 bytes, first value in the high nibble) and the f32 absmax per block.
void QuantizeNf4(const float* values, int64_t count, int64_t blocksize, uint8_t* packed,
                 float* absmax);

// Double quantisation of `blocks` absmax values: offset = their mean, then (absmax - offset)
// in groups of `nested_blocksize` to the nearest entry of DynamicMap8Bit() scaled by the
// group's largest magnitude.
void DoubleQuantizeAbsmax(const float* absmax, int64_t blocks, int64_t nested_blocksize,
                          uint8_t* absmax_q, float* nested_absmax, float* offset);

// Expansion to bf16 bits of the elements [begin, end) (row-major) of a weight.
struct Fp8Weight {
  const uint8_t* q = nullptr;
  const float* scale_inv = nullptr;  // [ceil(rows / block_rows), ceil(cols / block_cols)]
  int64_t rows = 0, cols = 0, block_rows = 0, block_cols = 0;
};
void ExpandFp8(const Fp8Weight& w, int64_t begin, int64_t end, uint16_t* out);

struct Nf4Weight {
  const uint8_t* packed = nullptr;
  const uint8_t* absmax = nullptr;
  const float* nested_absmax = nullptr;
  const float* quant_map = nullptr;         // 16
  const float* nested_quant_map = nullptr;  // 256
  float nested_offset = 0;
  int64_t numel = 0, blocksize = 0, nested_blocksize = 0;
};
void ExpandNf4(const Nf4Weight& w, int64_t begin, int64_t end, uint16_t* out);

}  // namespace lorastream::store
