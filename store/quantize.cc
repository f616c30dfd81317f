#include "store/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "store/convert.h"

namespace lorastream::store {

namespace {

std::array<float, 256> MakeE4M3Table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exp = (b >> 3) & 0xf, mant = b & 7;
    float v;
    if (exp == 0xf && mant == 7)
      v = std::nanf("");
    else if (exp == 0)
      v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
    else
      v = std::ldexp(1.0f + mant / 8.0f, exp - 7);
    t[b] = (b & 0x80) ? -v : v;
  }
  return t;
}

// torch.linspace(start, end, steps) in f32, as ATen computes it: from the start for the first
// half, from the end for the second.
std::vector<float> LinspaceF32(float start, float end, int steps) {
  const float step = (end - start) / static_cast<float>(steps - 1);
  std::vector<float> v(steps);
  const int half = steps / 2;
  for (int i = 0; i < steps; ++i)
    v[i] = i < half ? start + step * static_cast<float>(i)
                    : end - step * static_cast<float>(steps - i - 1);
  return v;
}

std::array<float, 256> MakeDynamicMap() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8).
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const std::vector<float> b = LinspaceF32(0.1f, 1.0f, (1 << i) + 1);
    const float scale = static_cast<float>(std::pow(10.0, -6 + i));
    for (size_t k = 0; k + 1 < b.size(); ++k) {
      const float mean = (b[k] + b[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  std::copy(data.begin(), data.end(), map.begin());
  return map;
}

// Index of the entry of the sorted `map` nearest to `x` (the lower one on a tie).
template <size_t N>
uint8_t Nearest(const std::array<float, N>& map, float x) {
  size_t hi;  // std::lower_bound's index: the number of entries below x
  if constexpr (N <= 16) {
    // Counted without a branch: nf4 quantises every weight through this, and a binary
    // search's branches mispredict on random weights.
    hi = 0;
    for (size_t k = 0; k < N; ++k) hi += map[k] < x ? 1 : 0;
  } else {
    hi = static_cast<size_t>(std::lower_bound(map.begin(), map.end(), x) - map.begin());
  }
  if (hi == 0) return 0;
  if (hi == N) return static_cast<uint8_t>(N - 1);
  return static_cast<uint8_t>(x - map[hi - 1] <= map[hi] - x ? hi - 1 : hi);
}

}  // namespace

const std::array<float, 16> kNf4Code = {-1.0f,
                                        -0.6961928009986877f,
                                        -0.5250730514526367f,
                                        -0.39491748809814453f,
                                        -0.28444138169288635f,
                                        -0.18477343022823334f,
                                        -0.09105003625154495f,
                                        0.0f,
                                        0.07958029955625534f,
                                        0.16093020141124725f,
                                        0.24611230194568634f,
                                        0.33791524171829224f,
                                        0.44070982933044434f,
                                        0.5626170039176941f,
                                        0.7229568362236023f,
                                        1.0f};

const std::array<float, 256>& DynamicMap8Bit() {
  static const std::array<float, 256> map = MakeDynamicMap();
  return map;
}

float E4M3ToFloat(uint8_t bits) {
  static const std::array<float, 256> table = MakeE4M3Table();
  return table[bits];
}

uint8_t FloatToE4M3(float value) {
  if (std::isnan(value)) return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0;
  const float a = std::min(std::fabs(value), kE4M3Max);
  if (a < 0.015625f) {  // below the smallest normal (2^-6): multiples of 2^-9
    // nearbyint rounds ties to even; 8 units is the smallest normal, whose code is also 8.
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  // A normal: the f32's 23 mantissa bits rounded to 3 on the bits themselves, to nearest
  // even (a carry out of the mantissa moves into the exponent, as it should), the exponent
  // rebiased from 127 to 7. Every f32 encodes as through frexp and nearbyint (checked over
  // all 2^32 of them), several times faster.
  uint32_t u;
  std::memcpy(&u, &a, sizeof u);
  const uint32_t rounded = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
  const uint32_t code = rounded - ((127u - 7u) << 3);
  return sign | static_cast<uint8_t>(std::min<uint32_t>(code, 0x7e));  // 448 at most
}

void QuantizeFp8Band(const float* band, int64_t rows, int64_t cols, int64_t block_cols, uint8_t* q,
                     float* scale_inv) {
  for (int64_t c0 = 0, tile = 0; c0 < cols; c0 += block_cols, ++tile) {
    const int64_t c1 = std::min(cols, c0 + block_cols);
    float amax = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(band[r * cols + c]));
    const float scale = amax > 0 ? amax / kE4M3Max : 1.0f;
    scale_inv[tile] = scale;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = FloatToE4M3(band[r * cols + c] / scale);
  }
}

void QuantizeNf4(const float* values, int64_t count, int64_t blocksize, uint8_t* packed,
                 float* absmax) {
  for (int64_t b0 = 0, block = 0; b0 < count; b0 += blocksize, ++block) {
    const int64_t b1 = std::min(count, b0 + blocksize);
    float amax = 0;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(values[i]));
    absmax[block] = amax;
    const float inv = amax > 0 ? 1.0f / amax : 0.0f;
    for (int64_t i = b0; i < b1; i += 2) {
      const uint8_t hi = Nearest(kNf4Code, values[i] * inv);
      const uint8_t lo = i + 1 < b1 ? Nearest(kNf4Code, values[i + 1] * inv) : 7;  // 7: zero
      packed[i / 2] = static_cast<uint8_t>(hi << 4 | lo);
    }
  }
}

void DoubleQuantizeAbsmax(const float* absmax, int64_t blocks, int64_t nested_blocksize,
                          uint8_t* absmax_q, float* nested_absmax, float* offset) {
  double sum = 0;
  for (int64_t i = 0; i < blocks; ++i) sum += absmax[i];
  const float mean = blocks > 0 ? static_cast<float>(sum / static_cast<double>(blocks)) : 0.0f;
  *offset = mean;
  const std::array<float, 256>& map = DynamicMap8Bit();
  for (int64_t g0 = 0, group = 0; g0 < blocks; g0 += nested_blocksize, ++group) {
    const int64_t g1 = std::min(blocks, g0 + nested_blocksize);
    float amax = 0;
    for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(absmax[i] - mean));
    nested_absmax[group] = amax;
    const float inv = amax > 0 ? 1.0f / amax : 0.0f;
    for (int64_t i = g0; i < g1; ++i) absmax_q[i] = Nearest(map, (absmax[i] - mean) * inv);
  }
}

void ExpandFp8(const Fp8Weight& w, int64_t begin, int64_t end, uint16_t* out) {
  const int64_t tiles_per_row = (w.cols + w.block_cols - 1) / w.block_cols;
  // Row by row, tile by tile: one scale per run of at most block_cols elements.
  for (int64_t i = begin; i < end;) {
    const int64_t r = i / w.cols, c = i % w.cols;
    const int64_t run_end =
        std::min({end, r * w.cols + (c / w.block_cols + 1) * w.block_cols, (r + 1) * w.cols});
    const float s = w.scale_inv[(r / w.block_rows) * tiles_per_row + c / w.block_cols];
    for (; i < run_end; ++i) out[i - begin] = FloatToBF16(E4M3ToFloat(w.q[i]) * s);
  }
}

void ExpandNf4(const Nf4Weight& w, int64_t begin, int64_t end, uint16_t* out) {
  // Block by block: one absmax per run of at most blocksize elements.
  for (int64_t i = begin; i < end;) {
    const int64_t block = i / w.blocksize;
    const int64_t run_end = std::min(end, (block + 1) * w.blocksize);
    const float scaled =
        w.nested_quant_map[w.absmax[block]] * w.nested_absmax[block / w.nested_blocksize];
    const float absmax = scaled + w.nested_offset;
    for (; i < run_end; ++i) {
      const uint8_t byte = w.packed[i / 2];
      const uint8_t code = (i % 2 == 0) ? byte >> 4 : byte & 0xf;
      out[i - begin] = FloatToBF16(w.quant_map[code] * absmax);
    }
  }
}

}  // namespace lorastream::store
