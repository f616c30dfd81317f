#include "common/finite_scan.h"

#include <cstring>

namespace lorastream {

namespace {

// A value is NaN or infinite exactly when its exponent bits are all ones.
template <class Bits>
int64_t Scan(const uint8_t* data, size_t count, Bits exponent_mask) {
  for (size_t i = 0; i < count; ++i) {
    Bits v;
    std::memcpy(&v, data + i * sizeof(Bits), sizeof(Bits));
    if ((v & exponent_mask) == exponent_mask) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(const uint8_t* data, size_t count, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return Scan<uint32_t>(data, count, 0x7F800000u);
    case DType::kF64:
      return Scan<uint64_t>(data, count, 0x7FF0000000000000ull);
    case DType::kF16:
      return Scan<uint16_t>(data, count, uint16_t{0x7C00});
    case DType::kBF16:
      return Scan<uint16_t>(data, count, uint16_t{0x7F80});
    case DType::kF8E5M2:
      return Scan<uint8_t>(data, count, uint8_t{0x7C});
    case DType::kF8E4M3:  // no infinities; NaN is S.1111.111
      for (size_t i = 0; i < count; ++i)
        if ((data[i] & 0x7F) == 0x7F) return static_cast<int64_t>(i);
      return -1;
    default:
      return -1;
  }
}

}  // namespace lorastream
