#include "store/convert.h"

#include <cmath>
#include <cstring>

#include "common/base/error.h"

namespace lorastream::store {

float BF16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;           // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;          // rounds to >= 65536 -> inf
  if (abs < 0x38800000u) {                                // half subnormal or zero
    const float scaled = std::fabs(value) * 16777216.0f;  // 2^24: units of the smallest subnormal
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  const uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((abs - 0x38000000u + rounding) >> 13);
}

bool ConvertibleToBF16(DType d) {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
}

void ConvertToBF16(DType src_dtype, const void* src, uint16_t* dst, size_t count) {
  switch (src_dtype) {
    case DType::kF32: {
      const float* s = static_cast<const float*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = FloatToBF16(s[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = FloatToBF16(HalfToFloat(s[i]));
      return;
    }
    case DType::kBF16:
      std::memcpy(dst, src, count * 2);
      return;
    default:
      throw Error(ErrorCode::kUnsupported,
                  std::string("cannot convert ") + DTypeName(src_dtype) + " to BF16");
  }
}

void ConvertToFloat(DType src_dtype, const void* src, float* dst, size_t count) {
  const auto* s = static_cast<const uint8_t*>(src);
  switch (src_dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16:
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, s + 2 * i, 2);
        dst[i] = src_dtype == DType::kBF16 ? BF16ToFloat(bits) : HalfToFloat(bits);
      }
      return;
    default:
      throw Error(ErrorCode::kUnsupported,
                  std::string("cannot convert ") + DTypeName(src_dtype) + " to F32");
  }
}

}  // namespace lorastream::store
