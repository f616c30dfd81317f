#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "store/checksum.h"
#include "store/convert.h"

using namespace lorastream;

namespace {
uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
}  // namespace

TEST_CASE("Xxh64 matches the reference xxHash vectors", "[store]") {
  CHECK(Xxh64("", 0) == 0xEF46DB3751D8E999ull);
  CHECK(Xxh64("a", 1) == 0xD24EC4F1A98C6E5Bull);
  CHECK(Xxh64("abc", 3) == 0x44BC2CF5AD770999ull);
}

TEST_CASE("segment checksum is independent of the thread count and sees every byte", "[store]") {
  std::vector<uint8_t> data(3 * kChecksumChunkBytes + 12345);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  const uint64_t one = SegmentChecksum(data.data(), data.size(), 1);
  CHECK(SegmentChecksum(data.data(), data.size(), 3) == one);
  CHECK(SegmentChecksum(data.data(), data.size() - 1, 2) != one);
  data[2 * kChecksumChunkBytes + 7] ^= 1;
  CHECK(SegmentChecksum(data.data(), data.size(), 2) != one);
}

TEST_CASE("F32 -> BF16 rounds to nearest even and keeps NaN and infinities", "[store]") {
  CHECK(FloatToBF16(1.0f) == 0x3F80);
  CHECK(FloatToBF16(FromBits(0x3F808000)) == 0x3F80);  // tie, even stays
  CHECK(FloatToBF16(FromBits(0x3F818000)) == 0x3F82);  // tie, odd rounds up
  CHECK(FloatToBF16(FromBits(0x3F808001)) == 0x3F81);  // above the tie
  CHECK(FloatToBF16(FromBits(0x3F807FFF)) == 0x3F80);  // below the tie
  CHECK(FloatToBF16(-2.0f) == 0xC000);
  CHECK(FloatToBF16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(FloatToBF16(FromBits(0x7F7FFFFF)) == 0x7F80);  // max float rounds to inf
  CHECK(std::isnan(BF16ToFloat(FloatToBF16(std::nanf("")))));
  CHECK(std::isnan(BF16ToFloat(FloatToBF16(FromBits(0x7F800001)))));  // signalling NaN stays NaN
  // Every BF16 value survives BF16 -> F32 -> BF16.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = BF16ToFloat(static_cast<uint16_t>(b));
    if (!std::isnan(f)) REQUIRE(FloatToBF16(f) == b);
  }
}

TEST_CASE("F16 <-> F32 is exact for every half value; F16 -> BF16 goes through it", "[store]") {
  CHECK(HalfToFloat(0x3C00) == 1.0f);
  CHECK(HalfToFloat(0x0001) == std::ldexp(1.0f, -24));
  CHECK(HalfToFloat(0x7BFF) == 65504.0f);
  CHECK(HalfToFloat(0xC000) == -2.0f);
  CHECK(FloatToHalf(65520.0f) == 0x7C00);
  CHECK(FloatToHalf(FromBits(0x3F801000)) == 0x3C00);  // tie to even
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(FloatToHalf(f) == h);
    uint16_t out;
    const uint16_t in = static_cast<uint16_t>(h);
    ConvertToBF16(DType::kF16, &in, &out, 1);
    REQUIRE(out == FloatToBF16(f));
  }
  (void)Bits;
}
