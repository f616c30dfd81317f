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

template <typename T>
__global__ void PairRopeKernel(bool backward, const T* in, T* out, const float* pe,
                               PairRopeShape s) {
  const int64_t pairs = s.dim / 2;
  const int64_t total = s.batch * s.heads * s.seq * pairs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const RotaryIndex at = SplitRotaryIndex(i, pairs, s.seq, s.heads);
    const int64_t j = at.pair, p = at.pos;
    const T* src = in + at.b * s.in_stride[0] + at.h * s.in_stride[1] + p * s.in_stride[2] + 2 * j;
    T* dst = out + at.b * s.out_stride[0] + at.h * s.out_stride[1] + p * s.out_stride[2] + 2 * j;
    const float* m = pe + at.b * s.pe_batch_stride + (p * pairs + j) * 4;
    const float x0 = ToF(src[0]), x1 = ToF(src[1]);
    // ATen multiplies, then adds (no fused multiply-add): the same roundings here.
    if (!backward) {
      dst[0] = FromF<T>(__fadd_rn(__fmul_rn(m[0], x0), __fmul_rn(m[1], x1)));
      dst[1] = FromF<T>(__fadd_rn(__fmul_rn(m[2], x0), __fmul_rn(m[3], x1)));
    } else {
      dst[0] = FromF<T>(__fadd_rn(__fmul_rn(m[0], x0), __fmul_rn(m[2], x1)));
      dst[1] = FromF<T>(__fadd_rn(__fmul_rn(m[1], x0), __fmul_rn(m[3], x1)));
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

void PairRope(KernelDtype t, bool backward, const void* in, void* out, const float* pe,
              const PairRopeShape& shape, cudaStream_t stream) {
  const int64_t n = shape.batch * shape.heads * shape.seq * (shape.dim / 2);
  if (n == 0) return;
  Dispatch(t, [&](auto v) {
    using T = decltype(v);
    PairRopeKernel<T><<<ElementwiseBlocks(n, 256), 256, 0, stream>>>(
        backward, static_cast<const T*>(in), static_cast<T*>(out), pe, shape);
  });
  Check(cudaGetLastError(), "PairRope");
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
