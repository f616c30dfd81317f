#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "store/checksum.h"
#include "store/convert.h"

using namespace lorastream;
using namespace lorastream::store;

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

namespace {
// The scalar form of BulkHash64's construction, independent of the SSE2 code path.
uint64_t ScalarBulkHash(const uint8_t* p, size_t n) {
  static const uint64_t secret[24] = {
      0xbe4ba423396cfeb8, 0x1cad21f72c81017c, 0xdb979083e96dd4de, 0x1f67b3b7a4a44072,
      0x78e5c0cc4ee679cb, 0x2172ffcc7dd05a82, 0x8e2443f7744608b8, 0x4c263a81e69035e0,
      0xcb00c391bb52283c, 0xa32e531b8b65d088, 0x4ef90da297486471, 0xd8acdea946ef1938,
      0x3f349ce33f76faa8, 0x1d4f0bc7c7bbdcf9, 0x3159b4cd4be0518a, 0x647378d9c97e9fc8,
      0xc3ebd33483acc5ea, 0xeb6313faffa081c5, 0x49daf0b751dd0d17, 0x9e68d429265516d3,
      0xfca1477d58be162b, 0xce31d07ad1b8f88f, 0x280416958f3acb45, 0x7e404bbbcafbd7af};
  uint64_t acc[8] = {0xC2B2AE3D27D4EB4F, 0x9E3779B185EBCA87, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                     0x27D4EB2F165667C5, 0x9E3779B1,         0x85EBCA77,         0xC2B2AE3D};
  const size_t stripes = n / 64;
  for (size_t s = 0; s < stripes; ++s) {
    for (int j = 0; j < 8; ++j) {
      uint64_t data;
      std::memcpy(&data, p + s * 64 + 8 * j, 8);
      const uint64_t dk = data ^ secret[s % 16 + j];
      acc[j ^ 1] += data;
      acc[j] += (dk & 0xffffffffu) * (dk >> 32);
    }
    if (s % 16 == 15)
      for (int j = 0; j < 8; ++j) acc[j] = (acc[j] ^ (acc[j] >> 47) ^ secret[16 + j]) * 0x9E3779B1u;
  }
  uint8_t tail[64 + 8 + 64];
  std::memcpy(tail, acc, 64);
  const uint64_t length = n;
  std::memcpy(tail + 64, &length, 8);
  std::memcpy(tail + 72, p + stripes * 64, n - stripes * 64);
  return Xxh64(tail, 72 + n - stripes * 64, 0x62756c6b);
}
}  // namespace

TEST_CASE("BulkHash64 equals its scalar definition and sees order and every byte", "[store]") {
  std::vector<uint8_t> data(5000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + (i >> 8));
  for (size_t n : {0, 1, 63, 64, 65, 1023, 1024, 1025, 4999, 5000})
    CHECK(BulkHash64(data.data(), n) == ScalarBulkHash(data.data(), n));
  const uint64_t h = BulkHash64(data.data(), data.size());
  std::vector<uint8_t> swapped = data;  // two stripes of one block exchanged
  std::swap_ranges(swapped.begin(), swapped.begin() + 64, swapped.begin() + 128);
  CHECK(BulkHash64(swapped.data(), swapped.size()) != h);
  for (size_t i : {0, 100, 1024, 4990}) {
    std::vector<uint8_t> flipped = data;
    flipped[i] ^= 0x10;
    CHECK(BulkHash64(flipped.data(), flipped.size()) != h);
  }
  std::vector<uint8_t> zeros(4096, 0);
  CHECK(BulkHash64(zeros.data(), 4096) != BulkHash64(zeros.data(), 4032));
}

TEST_CASE("BulkHasher fed in whole blocks equals BulkHash64", "[store]") {
  std::vector<uint8_t> data(10 * kBulkHashBlock + 77);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
  BulkHasher h;
  h.Update(data.data(), 3 * kBulkHashBlock);
  h.Update(data.data() + 3 * kBulkHashBlock, 5 * kBulkHashBlock);
  h.Update(data.data() + 8 * kBulkHashBlock, data.size() - 8 * kBulkHashBlock);
  CHECK(h.Finish() == BulkHash64(data.data(), data.size()));
}
