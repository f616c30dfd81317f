// BulkHash64: XXH3's long-input construction (accumulate 64-byte stripes into eight lanes
// with a stripe-dependent secret, scramble every 1 KiB), so that lanes carry no multiply
// dependency chain and SSE2 does two lanes per instruction.
#include <cstring>

#include "store/checksum.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace lorastream::store {

namespace {

constexpr size_t kStripe = 64;
constexpr size_t kStripesPerBlock = 16;
constexpr uint64_t kPrime32 = 0x9E3779B1u;

// 8 + 16 words: stripe s of a block uses words [s, s + 8); word 16.. also keys the scramble.
constexpr uint64_t kSecret[kStripesPerBlock + 8] = {
    0xbe4ba423396cfeb8, 0x1cad21f72c81017c, 0xdb979083e96dd4de, 0x1f67b3b7a4a44072,
    0x78e5c0cc4ee679cb, 0x2172ffcc7dd05a82, 0x8e2443f7744608b8, 0x4c263a81e69035e0,
    0xcb00c391bb52283c, 0xa32e531b8b65d088, 0x4ef90da297486471, 0xd8acdea946ef1938,
    0x3f349ce33f76faa8, 0x1d4f0bc7c7bbdcf9, 0x3159b4cd4be0518a, 0x647378d9c97e9fc8,
    0xc3ebd33483acc5ea, 0xeb6313faffa081c5, 0x49daf0b751dd0d17, 0x9e68d429265516d3,
    0xfca1477d58be162b, 0xce31d07ad1b8f88f, 0x280416958f3acb45, 0x7e404bbbcafbd7af};

[[maybe_unused]] uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

#if defined(__SSE2__)
void Accumulate(uint64_t* acc_words, const uint8_t* stripe, const uint64_t* secret) {
  __m128i* acc = reinterpret_cast<__m128i*>(acc_words);
  for (int i = 0; i < 4; ++i) {
    const __m128i data = _mm_loadu_si128(reinterpret_cast<const __m128i*>(stripe) + i);
    const __m128i key = _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret) + i);
    const __m128i dk = _mm_xor_si128(data, key);
    const __m128i dk_hi = _mm_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
    const __m128i product = _mm_mul_epu32(dk, dk_hi);  // lo32 * hi32 per lane
    const __m128i swapped = _mm_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    acc[i] = _mm_add_epi64(acc[i], _mm_add_epi64(product, swapped));
  }
}
void Scramble(uint64_t* acc_words, const uint64_t* secret) {
  __m128i* acc = reinterpret_cast<__m128i*>(acc_words);
  const __m128i prime = _mm_set1_epi32(static_cast<int>(kPrime32));
  for (int i = 0; i < 4; ++i) {
    __m128i a = _mm_xor_si128(acc[i], _mm_srli_epi64(acc[i], 47));
    a = _mm_xor_si128(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret) + i));
    const __m128i lo = _mm_mul_epu32(a, prime);
    const __m128i hi = _mm_mul_epu32(_mm_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1)), prime);
    acc[i] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
  }
}
#else
void Accumulate(uint64_t* acc, const uint8_t* stripe, const uint64_t* secret) {
  for (int j = 0; j < 8; ++j) {
    const uint64_t data = Load64(stripe + 8 * j);
    const uint64_t dk = data ^ secret[j];
    acc[j ^ 1] += data;
    acc[j] += (dk & 0xffffffffu) * (dk >> 32);
  }
}
void Scramble(uint64_t* acc, const uint64_t* secret) {
  for (int j = 0; j < 8; ++j) {
    uint64_t a = acc[j] ^ (acc[j] >> 47);
    a ^= secret[j];
    acc[j] = a * kPrime32;
  }
}
#endif

}  // namespace

BulkHasher::BulkHasher()
    : acc_{0xC2B2AE3D27D4EB4F, 0x9E3779B185EBCA87, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
           0x27D4EB2F165667C5, 0x9E3779B1,         0x85EBCA77,         0xC2B2AE3D} {}

void BulkHasher::Update(const void* data, size_t n) {
  // Stripe positions inside a block key the secret, so only whole blocks may precede this.
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const size_t stripes = n / kStripe;
  for (size_t s = 0; s < stripes; ++s) {
    Accumulate(acc_, p + s * kStripe, kSecret + s % kStripesPerBlock);
    if (s % kStripesPerBlock == kStripesPerBlock - 1) Scramble(acc_, kSecret + kStripesPerBlock);
  }
  tail_size_ = n - stripes * kStripe;
  std::memcpy(tail_, p + stripes * kStripe, tail_size_);
  length_ += n;
}

uint64_t BulkHasher::Finish() const {
  // The lanes, the length and the tail (< 64 bytes) go through XXH64.
  uint8_t buffer[8 * 8 + 8 + kStripe];
  std::memcpy(buffer, acc_, sizeof(acc_));
  std::memcpy(buffer + 64, &length_, 8);
  std::memcpy(buffer + 72, tail_, tail_size_);
  return Xxh64(buffer, 72 + tail_size_, 0x62756c6b);
}

uint64_t BulkHash64(const void* data, size_t n) {
  BulkHasher h;
  h.Update(data, n);
  return h.Finish();
}

}  // namespace lorastream::store
