#include "worker/model/cuda/fused_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include <stdexcept>
#include <string>

namespace lorastream::worker::cuda {

namespace {

// Round-trips between the storage type and f32 (the "opmath" type ATen computes in).
__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToF(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T FromF(float v);
template <>
__device__ __forceinline__ float FromF<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half FromF<__half>(float v) {
  return __float2half(v);
}
// One rounding to T, as an ATen op writing a T tensor does.
template <typename T>
__device__ __forceinline__ float Round(float v) {
  return ToF(FromF<T>(v));
}

constexpr int kRowThreads = 256;

// Sum of v over the block (every thread gets it); `shared` holds one float per warp.
__device__ float BlockSum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? shared[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  return v;
}

template <typename T>
__global__ void RmsNormForwardKernel(const T* x, const T* w, T* y, float* rstd, int64_t cols,
                                     float eps) {
  __shared__ float shared[32];
  const T* row = x + blockIdx.x * cols;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = ToF(row[c]);
    sum += v * v;
  }
  const float r = rsqrtf(BlockSum(sum, shared) / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  T* out = y + blockIdx.x * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    out[c] = FromF<T>(ToF(w[c]) * Round<T>(ToF(row[c]) * r));
}

template <typename T>
__global__ void RmsNormBackwardKernel(const T* dy, const T* x, const float* rstd, const T* w, T* dx,
                                      int64_t cols) {
  __shared__ float shared[32];
  const int64_t base = blockIdx.x * cols;
  const float r = rstd[blockIdx.x];
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dot += Round<T>(ToF(dy[base + c]) * ToF(w[c])) * (ToF(x[base + c]) * r);
  const float mean = BlockSum(dot, shared) / static_cast<float>(cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float dn = Round<T>(ToF(dy[base + c]) * ToF(w[c]));
    const float n = ToF(x[base + c]) * r;
    dx[base + c] = FromF<T>((dn - n * mean) * r);
  }
}

__device__ __forceinline__ float Sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

template <typename T>
__global__ void SwiGluForwardKernel(const T* gate, const T* up, T* z, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = ToF(gate[i]);
    z[i] = FromF<T>(Round<T>(g / (1.f + expf(-g))) * ToF(up[i]));
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(const T* dz, const T* gate, const T* up, T* dgate, T* dup,
                                     int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = ToF(gate[i]), d = ToF(dz[i]);
    const float s = Sigmoid(g);
    const float t = Round<T>(d * ToF(up[i]));
    dgate[i] = FromF<T>(t * s * (1.f + g * (1.f - s)));
    dup[i] = FromF<T>(d * Round<T>(g / (1.f + expf(-g))));
  }
}

// Element i of a rotary kernel's [B, H, L, pairs] iteration space.
struct RotaryIndex {
  int64_t b, h, pos, pair;
};
__device__ __forceinline__ RotaryIndex SplitRotaryIndex(int64_t i, int64_t pairs, int64_t seq,
                                                        int64_t heads) {
  RotaryIndex at;
  at.pair = i % pairs;
  i /= pairs;
  at.pos = i % seq;
  i /= seq;
  at.h = i % heads;
  at.b = i / heads;
  return at;
}

template <typename T>
__global__ void RopeKernel(bool backward, const T* in, T* out, const T* cos, const T* sin,
                           RopeShape s) {
  const int64_t half = s.dim / 2;
  const int64_t total = s.batch * s.heads * s.seq * half;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const RotaryIndex at = SplitRotaryIndex(i, half, s.seq, s.heads);
    const int64_t d = at.pair, p = at.pos;
    const T* src = in + at.b * s.in_stride[0] + at.h * s.in_stride[1] + p * s.in_stride[2];
    T* dst = out + at.b * s.out_stride[0] + at.h * s.out_stride[1] + p * s.out_stride[2];
    const float x1 = ToF(src[d]), x2 = ToF(src[d + half]);
    const float c1 = ToF(cos[p * s.dim + d]), c2 = ToF(cos[p * s.dim + d + half]);
    const float s1 = ToF(sin[p * s.dim + d]), s2 = ToF(sin[p * s.dim + d + half]);
    if (!backward) {
      // rotate_half(x) = (-x2, x1)
      dst[d] = FromF<T>(Round<T>(x1 * c1) + Round<T>(-x2 * s1));
      dst[d + half] = FromF<T>(Round<T>(x2 * c2) + Round<T>(x1 * s2));
    } else {
      // rotate_half^T(y) = (y2, -y1) applied to y = g * sin
      dst[d] = FromF<T>(Round<T>(x1 * c1) + Round<T>(x2 * s2));
      dst[d + half] = FromF<T>(Round<T>(x2 * c2) - Round<T>(x1 * s1));
    }
  }
}

// Joint attention's heads: one warp per row, each lane holding pairs lane, lane + 32, ...
constexpr int kHeadsMaxPairsPerLane = 4;  // D <= 256
constexpr int kHeadsWarpsPerBlock = 8;

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct HeadsRow {
  int64_t b, l, h;
};
// The warp's row, or false past the last one (the whole warp returns: every lane shuffles).
__device__ __forceinline__ bool HeadsRowOf(const HeadsShape& s, HeadsRow* row) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (warp >= s.batch * s.seq * s.heads) return false;
  row->h = warp % s.heads;
  row->l = (warp / s.heads) % s.seq;
  row->b = warp / (s.heads * s.seq);
  return true;
}

// The row's pairs of x in f32 (lanes past D / 2 hold zeros) and its rstd.
template <typename T>
__device__ __forceinline__ float LoadHeadRow(const T* x, int64_t pairs, float eps, bool norm,
                                             float (&v0)[kHeadsMaxPairsPerLane],
                                             float (&v1)[kHeadsMaxPairsPerLane]) {
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kHeadsMaxPairsPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    v0[i] = j < pairs ? ToF(x[2 * j]) : 0.f;
    v1[i] = j < pairs ? ToF(x[2 * j + 1]) : 0.f;
    sum += v0[i] * v0[i];
    sum += v1[i] * v1[i];
  }
  if (!norm) return 1.f;
  return rsqrtf(WarpSum(sum) / static_cast<float>(2 * pairs) + eps);
}

template <typename T>
__global__ void HeadsForwardKernel(const T* src, const T* scale, const float* pe, T* dst,
                                   HeadsShape s, float eps) {
  HeadsRow row;
  if (!HeadsRowOf(s, &row)) return;
  const int lane = threadIdx.x % 32;
  const int64_t pairs = s.dim / 2;
  const T* x = src + row.b * s.src_stride[0] + row.l * s.src_stride[1] + row.h * s.dim;
  T* y = dst + row.b * s.dst_stride[0] + row.h * s.dst_stride[1] + row.l * s.dst_stride[2];
  const float* m_row =
      pe ? pe + row.b * s.pe_batch_stride + (s.pos_offset + row.l) * pairs * 4 : nullptr;
  float v0[kHeadsMaxPairsPerLane], v1[kHeadsMaxPairsPerLane];
  const float r = LoadHeadRow(x, pairs, eps, scale != nullptr, v0, v1);
#pragma unroll
  for (int i = 0; i < kHeadsMaxPairsPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    if (j >= pairs) break;
    float y0 = v0[i], y1 = v1[i];
    if (scale) {
      y0 = Round<T>(ToF(scale[2 * j]) * Round<T>(y0 * r));
      y1 = Round<T>(ToF(scale[2 * j + 1]) * Round<T>(y1 * r));
    }
    if (m_row) {
      const float* m = m_row + j * 4;
      const float r0 = __fadd_rn(__fmul_rn(m[0], y0), __fmul_rn(m[1], y1));
      const float r1 = __fadd_rn(__fmul_rn(m[2], y0), __fmul_rn(m[3], y1));
      y0 = r0;
      y1 = r1;
    }
    y[2 * j] = FromF<T>(y0);
    y[2 * j + 1] = FromF<T>(y1);
  }
}

template <typename T>
__global__ void HeadsBackwardKernel(const T* dy, const T* src, const T* scale, const float* pe,
                                    T* dsrc, HeadsShape s, float eps) {
  HeadsRow row;
  if (!HeadsRowOf(s, &row)) return;
  const int lane = threadIdx.x % 32;
  const int64_t pairs = s.dim / 2;
  const int64_t src_at = row.b * s.src_stride[0] + row.l * s.src_stride[1] + row.h * s.dim;
  const T* g = dy + row.b * s.dst_stride[0] + row.h * s.dst_stride[1] + row.l * s.dst_stride[2];
  const float* m_row =
      pe ? pe + row.b * s.pe_batch_stride + (s.pos_offset + row.l) * pairs * 4 : nullptr;
  float v0[kHeadsMaxPairsPerLane], v1[kHeadsMaxPairsPerLane];
  const float r = LoadHeadRow(src + src_at, pairs, eps, scale != nullptr, v0, v1);
  float d0[kHeadsMaxPairsPerLane], d1[kHeadsMaxPairsPerLane];
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < kHeadsMaxPairsPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    d0[i] = d1[i] = 0.f;
    if (j >= pairs) continue;
    float g0 = ToF(g[2 * j]), g1 = ToF(g[2 * j + 1]);
    if (m_row) {
      const float* m = m_row + j * 4;
      const float r0 = Round<T>(__fadd_rn(__fmul_rn(m[0], g0), __fmul_rn(m[2], g1)));
      const float r1 = Round<T>(__fadd_rn(__fmul_rn(m[1], g0), __fmul_rn(m[3], g1)));
      g0 = r0;
      g1 = r1;
    }
    if (scale) {
      g0 = Round<T>(g0 * ToF(scale[2 * j]));
      g1 = Round<T>(g1 * ToF(scale[2 * j + 1]));
      dot += g0 * (v0[i] * r);
      dot += g1 * (v1[i] * r);
    }
    d0[i] = g0;
    d1[i] = g1;
  }
  const float mean = scale ? WarpSum(dot) / static_cast<float>(s.dim) : 0.f;
  T* dx = dsrc + src_at;
#pragma unroll
  for (int i = 0; i < kHeadsMaxPairsPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    if (j >= pairs) break;
    if (scale) {
      dx[2 * j] = FromF<T>((d0[i] - v0[i] * r * mean) * r);
      dx[2 * j + 1] = FromF<T>((d1[i] - v1[i] * r * mean) * r);
    } else {
      dx[2 * j] = FromF<T>(d0[i]);
      dx[2 * j + 1] = FromF<T>(d1[i]);
    }
  }
}

constexpr int kCrossEntropyThreads = 1024;

// (max, sum of exp(x - max)) pairs, merged: the online softmax's reduction.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum Merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// The block's merged pair (every thread gets it); `shared` holds one pair per warp.
__device__ MaxSum BlockMaxSum(MaxSum v, MaxSum* shared) {
  for (int o = 16; o > 0; o >>= 1)
    v = Merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? shared[lane] : MaxSum{-INFINITY, 0.f};
  for (int o = 16; o > 0; o >>= 1)
    v = Merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  __syncthreads();
  return v;
}

template <typename T>
__global__ void CrossEntropyKernel(T* logits, const int64_t* targets, float* row_loss,
                                   int64_t vocab, bool grad) {
  __shared__ MaxSum shared[32];
  T* row = logits + blockIdx.x * vocab;
  const int64_t target = targets[blockIdx.x];
  const bool valid = target >= 0 && target < vocab;
  // Read before any thread overwrites the row (the writes follow the reduction's barriers).
  const float x_target = valid && threadIdx.x == 0 ? ToF(row[target]) : 0.f;
  MaxSum acc{-INFINITY, 0.f};
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float x = ToF(row[c]);
    if (x > acc.m) {
      acc.s = acc.s * expf(acc.m - x) + 1.f;
      acc.m = x;
    } else if (acc.m != -INFINITY) {
      acc.s += expf(x - acc.m);
    }
  }
  const MaxSum all = BlockMaxSum(acc, shared);
  if (threadIdx.x == 0) row_loss[blockIdx.x] = valid ? all.m + logf(all.s) - x_target : 0.f;
  if (!grad) return;
  const float inv = 1.f / all.s;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float g = valid ? expf(ToF(row[c]) - all.m) * inv - (c == target ? 1.f : 0.f) : 0.f;
    row[c] = FromF<T>(g);
  }
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

unsigned ElementwiseBlocks(int64_t n, int threads) {
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(want < 65535 * 8 ? (want > 0 ? want : 1) : 65535 * 8);
}

template <typename F>
void Dispatch(KernelDtype t, F&& f) {
  switch (t) {
    case KernelDtype::kF32:
      f(float{});
      return;
    case KernelDtype::kBF16:
      f(__nv_bfloat16{});
      return;
    case KernelDtype::kF16:
      f(__half{});
      return;
  }
}

}  // namespace

void RmsNormForward(KernelDtype t, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                    int64_t cols, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    RmsNormForwardKernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, cols, eps);
  });
  Check(cudaGetLastError(), "RmsNormForward");
}

void RmsNormBackward(KernelDtype t, const void* dy, const void* x, const float* rstd, const void* w,
                     void* dx, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    RmsNormBackwardKernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), rstd, static_cast<const T*>(w),
        static_cast<T*>(dx), cols);
  });
  Check(cudaGetLastError(), "RmsNormBackward");
}

void SwiGluForward(KernelDtype t, const void* gate, const void* up, void* z, int64_t n,
                   cudaStream_t stream) {
  if (n == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    SwiGluForwardKernel<T><<<ElementwiseBlocks(n, 256), 256, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(z), n);
  });
  Check(cudaGetLastError(), "SwiGluForward");
}

void SwiGluBackward(KernelDtype t, const void* dz, const void* gate, const void* up, void* dgate,
                    void* dup, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    SwiGluBackwardKernel<T><<<ElementwiseBlocks(n, 256), 256, 0, stream>>>(
        static_cast<const T*>(dz), static_cast<const T*>(gate), static_cast<const T*>(up),
        static_cast<T*>(dgate), static_cast<T*>(dup), n);
  });
  Check(cudaGetLastError(), "SwiGluBackward");
}

void Rope(KernelDtype t, bool backward, const void* in, void* out, const void* cos, const void* sin,
          const RopeShape& shape, cudaStream_t stream) {
  const int64_t n = shape.batch * shape.heads * shape.seq * (shape.dim / 2);
  if (n == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    RopeKernel<T><<<ElementwiseBlocks(n, 256), 256, 0, stream>>>(
        backward, static_cast<const T*>(in), static_cast<T*>(out), static_cast<const T*>(cos),
        static_cast<const T*>(sin), shape);
  });
  Check(cudaGetLastError(), "Rope");
}

static unsigned HeadsBlocks(const HeadsShape& s) {
  const int64_t rows = s.batch * s.seq * s.heads;
  return static_cast<unsigned>((rows + kHeadsWarpsPerBlock - 1) / kHeadsWarpsPerBlock);
}

static void CheckHeadsShape(const HeadsShape& s) {
  if (s.dim % 2 != 0 || s.dim > 2 * 32 * kHeadsMaxPairsPerLane)
    throw std::invalid_argument("heads kernel: head dim " + std::to_string(s.dim) +
                                " is odd or above 256");
}

void HeadsForward(KernelDtype t, const void* src, const void* scale, const float* pe, void* dst,
                  const HeadsShape& shape, float eps, cudaStream_t stream) {
  CheckHeadsShape(shape);
  if (shape.batch * shape.seq * shape.heads == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    HeadsForwardKernel<T><<<HeadsBlocks(shape), 32 * kHeadsWarpsPerBlock, 0, stream>>>(
        static_cast<const T*>(src), static_cast<const T*>(scale), pe, static_cast<T*>(dst), shape,
        eps);
  });
  Check(cudaGetLastError(), "HeadsForward");
}

void HeadsBackward(KernelDtype t, const void* dy, const void* src, const void* scale,
                   const float* pe, void* dsrc, const HeadsShape& shape, float eps,
                   cudaStream_t stream) {
  CheckHeadsShape(shape);
  if (shape.batch * shape.seq * shape.heads == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    HeadsBackwardKernel<T><<<HeadsBlocks(shape), 32 * kHeadsWarpsPerBlock, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(src), static_cast<const T*>(scale), pe,
        static_cast<T*>(dsrc), shape, eps);
  });
  Check(cudaGetLastError(), "HeadsBackward");
}

void CrossEntropyRows(KernelDtype t, void* logits, const int64_t* targets, float* row_loss,
                      int64_t rows, int64_t vocab, bool grad_in_place, cudaStream_t stream) {
  if (rows == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    CrossEntropyKernel<T><<<static_cast<unsigned>(rows), kCrossEntropyThreads, 0, stream>>>(
        static_cast<T*>(logits), targets, row_loss, vocab, grad_in_place);
  });
  Check(cudaGetLastError(), "CrossEntropyRows");
}

}  // namespace lorastream::worker::cuda
