// FirstNonFinite: the first NaN or infinity of every float dtype, wherever it lies against the
// scan's runs (inside one, on a run's edges, in the tail after the last whole run).
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "common/base/finite_scan.h"

using namespace lorastream;

namespace {

// `count` values of `size` bytes each, every one 1.0's bit pattern (finite).
std::vector<uint8_t> Finite(size_t count, size_t size, uint64_t one) {
  std::vector<uint8_t> data(count * size);
  for (size_t i = 0; i < count; ++i) std::memcpy(data.data() + i * size, &one, size);
  return data;
}

void Put(std::vector<uint8_t>& data, size_t index, size_t size, uint64_t bits) {
  std::memcpy(data.data() + index * size, &bits, size);
}

}  // namespace

TEST_CASE("FirstNonFinite finds the first NaN or infinity of each float dtype", "[common]") {
  struct Case {
    DType dtype;
    size_t size;
    uint64_t one, nan, inf;  // little-endian bit patterns
  };
  const std::vector<Case> cases = {
      {DType::kF32, 4, 0x3F800000u, 0x7FC00000u, 0xFF800000u},
      {DType::kF64, 8, 0x3FF0000000000000ull, 0x7FF8000000000000ull, 0x7FF0000000000000ull},
      {DType::kF16, 2, 0x3C00, 0x7E00, 0xFC00},
      {DType::kBF16, 2, 0x3F80, 0x7FC0, 0x7F80},
      {DType::kF8E5M2, 1, 0x3C, 0x7E, 0xFC},
      {DType::kF8E4M3, 1, 0x38, 0x7F, 0xFF},  // no infinity: S.1111.111 is NaN
  };
  const size_t count = 3 * 4096 + 100;  // three whole runs and a tail
  for (const Case& c : cases) {
    INFO("dtype " << static_cast<int>(c.dtype));
    std::vector<uint8_t> data = Finite(count, c.size, c.one);
    CHECK(FirstNonFinite(data.data(), count, c.dtype) == -1);
    CHECK(FirstNonFinite(data.data(), 0, c.dtype) == -1);
    for (size_t at : {size_t{0}, size_t{7}, size_t{4095}, size_t{4096}, size_t{8191},
                      size_t{3 * 4096}, count - 1}) {
      INFO("at " << at);
      for (uint64_t bad : {c.nan, c.inf}) {
        std::vector<uint8_t> d = data;
        Put(d, at, c.size, bad);
        CHECK(FirstNonFinite(d.data(), count, c.dtype) == static_cast<int64_t>(at));
        Put(d, count - 1 == at ? 0 : count - 1, c.size, c.nan);  // a second one: the first wins
        CHECK(FirstNonFinite(d.data(), count, c.dtype) ==
              static_cast<int64_t>(count - 1 == at ? 0 : at));
        CHECK(FirstNonFinite(d.data(), at, c.dtype) == (count - 1 == at ? 0 : -1));  // before it
      }
    }
  }
  // Integer dtypes hold neither.
  const std::vector<uint8_t> ints(4096 * 4 + 3, 0xFF);
  CHECK(FirstNonFinite(ints.data(), ints.size() / 4, DType::kI32) == -1);
}
