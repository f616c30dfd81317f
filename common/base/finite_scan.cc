#include "common/base/finite_scan.h"

#include <cstring>

namespace lorastream {

namespace {

// A value is NaN or infinite exactly when its exponent bits are all ones. Whole runs of
// kRun values are tested without an early exit and with a constant trip count, which the
// compiler vectorises (the scan reads a whole checkpoint at every store start); the index is
// then searched for from the first run that holds one.
constexpr size_t kRun = 4096;

template <class Bits>
bool RunHasNonFinite(const uint8_t* data, Bits exponent_mask) {
  Bits found = 0;
  for (size_t i = 0; i < kRun; ++i) {
    Bits v;
    std::memcpy(&v, data + i * sizeof(Bits), sizeof(Bits));
    found |= static_cast<Bits>((v & exponent_mask) == exponent_mask);
  }
  return found != 0;
}

template <class Bits>
int64_t Scan(const uint8_t* data, size_t count, Bits exponent_mask) {
  size_t begin = 0;
  while (begin + kRun <= count && !RunHasNonFinite(data + begin * sizeof(Bits), exponent_mask))
    begin += kRun;
  for (size_t i = begin; i < count; ++i) {
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
    case DType::kF8E4M3:  // no infinities; NaN is S.1111.111 (every bit of the "mask" set)
      return Scan<uint8_t>(data, count, uint8_t{0x7F});
    default:
      return -1;
  }
}

}  // namespace lorastream
