#include "worker/model/cuda/quant_kernels.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace lorastream::worker::cuda {

namespace {

constexpr int kThreads = 256;

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

int Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

// e4m3fn exactly: normal 2^(e-7) * (1 + m/8) assembled as f32 bits, subnormal m * 2^-9.
__device__ __forceinline__ float E4M3ToFloat(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xf, m = b & 7, s = b >> 7;
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * 0.001953125f;
  } else if (e == 0xf && m == 7) {
    v = __int_as_float(0x7fc00000);
  } else {
    v = __uint_as_float(((e + 120u) << 23) | (m << 20));
  }
  return s ? -v : v;
}

__device__ __forceinline__ uint16_t Bf16Bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// NF4 block b's absmax from its double-quantised code: nested_map[code] * the code group's
// absmax, plus the offset (bitsandbytes' definition, rounded as the CPU path rounds it).
template <typename I>
__device__ __forceinline__ float Nf4Absmax(const uint8_t* absmax, const float* nested_absmax,
                                           const float* nested_map, float offset, I b, I nested) {
  return __fadd_rn(__fmul_rn(nested_map[absmax[b]], nested_absmax[b / nested]), offset);
}

// One row per grid row, its columns across the block: one scale load per tile, 32-bit index
// math where the weight allows it (I = int32_t).
template <typename I>
__global__ void ExpandFp8Kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale,
                                I rows, I cols, I br, I bc, uint16_t* __restrict__ out) {
  const I tiles = (cols + bc - 1) / bc;
  for (I r = blockIdx.y; r < rows; r += gridDim.y) {
    const float* srow = scale + static_cast<int64_t>(r / br) * tiles;
    const uint8_t* qrow = q + static_cast<int64_t>(r) * cols;
    uint16_t* orow = out + static_cast<int64_t>(r) * cols;
    for (I c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)
      orow[c] = Bf16Bits(__fmul_rn(E4M3ToFloat(qrow[c]), srow[c / bc]));
  }
}

// One thread per packed byte: its two elements share a block (blocksize is even).
template <typename I>
__global__ void ExpandNf4Kernel(const uint8_t* __restrict__ packed,
                                const uint8_t* __restrict__ absmax,
                                const float* __restrict__ nested_absmax,
                                const float* __restrict__ quant_map,
                                const float* __restrict__ nested_map,
                                const float* __restrict__ offset, I numel, I blocksize, I nested,
                                uint16_t* __restrict__ out) {
  const I bytes = (numel + 1) / 2;
  const float off = *offset;
  for (I k = blockIdx.x * blockDim.x + threadIdx.x; k < bytes; k += gridDim.x * blockDim.x) {
    const uint8_t byte = packed[k];
    const I i = 2 * k, b = i / blocksize;
    const float a = Nf4Absmax(absmax, nested_absmax, nested_map, off, b, nested);
    out[i] = Bf16Bits(__fmul_rn(quant_map[byte >> 4], a));
    if (i + 1 < numel) out[i + 1] = Bf16Bits(__fmul_rn(quant_map[byte & 0xf], a));
  }
}

// The same arithmetic eight elements a thread, for weights whose rows, tiles and blocks are
// multiples of eight and whose pointers allow the wide accesses (Wide below): one 8-byte load
// of fp8 codes or one 4-byte load of nf4 nibbles, one scale or absmax, one 16-byte store. The
// byte-a-thread kernels above move a few percent of the device's bandwidth; these are bound
// by it, so a resident block kept compressed can expand at every use.
__device__ __forceinline__ uint32_t Bf16Pair(float lo, float hi) {
  return static_cast<uint32_t>(Bf16Bits(lo)) | (static_cast<uint32_t>(Bf16Bits(hi)) << 16);
}

template <typename I>
__global__ void ExpandFp8Kernel8(const uint8_t* __restrict__ q, const float* __restrict__ scale,
                                 I rows, I cols, I br, I bc, uint16_t* __restrict__ out) {
  const I tiles = (cols + bc - 1) / bc, groups = cols / 8;
  for (I r = blockIdx.y; r < rows; r += gridDim.y) {
    const float* srow = scale + static_cast<int64_t>(r / br) * tiles;
    const uint2* qrow = reinterpret_cast<const uint2*>(q + static_cast<int64_t>(r) * cols);
    uint4* orow = reinterpret_cast<uint4*>(out + static_cast<int64_t>(r) * cols);
    for (I g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
      const uint2 codes = qrow[g];
      const float s = srow[g * 8 / bc];
      auto v = [&](uint32_t word, int k) {
        return __fmul_rn(E4M3ToFloat((word >> (8 * k)) & 0xff), s);
      };
      orow[g] = make_uint4(
          Bf16Pair(v(codes.x, 0), v(codes.x, 1)), Bf16Pair(v(codes.x, 2), v(codes.x, 3)),
          Bf16Pair(v(codes.y, 0), v(codes.y, 1)), Bf16Pair(v(codes.y, 2), v(codes.y, 3)));
    }
  }
}

template <typename I>
__global__ void ExpandNf4Kernel8(const uint8_t* __restrict__ packed,
                                 const uint8_t* __restrict__ absmax,
                                 const float* __restrict__ nested_absmax,
                                 const float* __restrict__ quant_map,
                                 const float* __restrict__ nested_map,
                                 const float* __restrict__ offset, I numel, I blocksize, I nested,
                                 uint16_t* __restrict__ out) {
  const I groups = numel / 8;
  const float off = *offset;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed);
  uint4* out8 = reinterpret_cast<uint4*>(out);
  for (I g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
    const uint32_t word = words[g];  // bytes 4g..4g+3: elements 8g.., the first in a high nibble
    const I b = 8 * g / blocksize;
    const float a = Nf4Absmax(absmax, nested_absmax, nested_map, off, b, nested);
    auto pair = [&](int k) {
      const uint32_t byte = (word >> (8 * k)) & 0xff;
      return Bf16Pair(__fmul_rn(quant_map[byte >> 4], a), __fmul_rn(quant_map[byte & 0xf], a));
    };
    out8[g] = make_uint4(pair(0), pair(1), pair(2), pair(3));
  }
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool FitsInt32(int64_t n) { return n < (int64_t{1} << 31) - 2 * 65535 * kThreads; }

// Calls launch(I{}) with the index type a weight of n elements allows: 32-bit where it fits.
template <typename Launch>
void WithIndexType(int64_t n, const Launch& launch) {
  if (FitsInt32(n))
    launch(int32_t{});
  else
    launch(int64_t{});
}

}  // namespace

void ExpandFp8(const uint8_t* q, const float* scale_inv, int64_t rows, int64_t cols,
               int64_t block_rows, int64_t block_cols, uint16_t* out, cudaStream_t stream) {
  if (rows * cols == 0) return;
  const bool wide = cols % 8 == 0 && block_cols % 8 == 0 && Aligned(q, 8) && Aligned(out, 16);
  const int64_t per_row = wide ? cols / 8 : cols;  // threads' work items in a row
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((per_row + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  WithIndexType(rows * cols, [&](auto index) {
    using I = decltype(index);
    const auto kernel = wide ? ExpandFp8Kernel8<I> : ExpandFp8Kernel<I>;
    kernel<<<grid, kThreads, 0, stream>>>(q, scale_inv, static_cast<I>(rows), static_cast<I>(cols),
                                          static_cast<I>(block_rows), static_cast<I>(block_cols),
                                          out);
  });
  Check(cudaGetLastError(), "ExpandFp8 launch");
}

void ExpandNf4(const uint8_t* packed, const uint8_t* absmax, const float* nested_absmax,
               const float* quant_map, const float* nested_quant_map, const float* nested_offset,
               int64_t numel, int64_t blocksize, int64_t nested_blocksize, uint16_t* out,
               cudaStream_t stream) {
  if (numel == 0) return;
  const bool wide = numel % 8 == 0 && blocksize % 8 == 0 && Aligned(packed, 4) && Aligned(out, 16);
  const int blocks = Blocks(wide ? numel / 8 : (numel + 1) / 2);
  WithIndexType(numel, [&](auto index) {
    using I = decltype(index);
    const auto kernel = wide ? ExpandNf4Kernel8<I> : ExpandNf4Kernel<I>;
    kernel<<<blocks, kThreads, 0, stream>>>(
        packed, absmax, nested_absmax, quant_map, nested_quant_map, nested_offset,
        static_cast<I>(numel), static_cast<I>(blocksize), static_cast<I>(nested_blocksize), out);
  });
  Check(cudaGetLastError(), "ExpandNf4 launch");
}

}  // namespace lorastream::worker::cuda
