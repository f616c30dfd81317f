// Element conversions the store needs (F32/F16 -> BF16 on load) and tests use to check them.
// Rounding is to nearest, ties to even, as torch's .to(torch.bfloat16); NaN stays NaN.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/base/dtype.h"

namespace lorastream::store {

inline uint16_t FloatToBF16(float value);  // defined below: inlined into hot loops
float BF16ToFloat(uint16_t bits);
float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);  // round to nearest even; overflow -> inf

// Converts `count` elements of `src_dtype` (F32, F16 or BF16) to BF16.
void ConvertToBF16(DType src_dtype, const void* src, uint16_t* dst, size_t count);

// Converts `count` elements of `src_dtype` (F32, F16 or BF16) to F32 (exactly).
void ConvertToFloat(DType src_dtype, const void* src, float* dst, size_t count);

// True for the dtypes ConvertToBF16 accepts.
bool ConvertibleToBF16(DType dtype);

inline uint16_t FloatToBF16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace lorastream::store
