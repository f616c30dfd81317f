#include "worker/train/cuda/adamw8bit_kernel.h"

#include <cfloat>

namespace lorastream::worker::cuda {

namespace {

constexpr int kWarps = kEightBitThreads / 32;

// The number of the 255 midpoints below x: the nearest entry's index (ATen's searchsorted,
// side left, over the same midpoints).
__device__ int NearestIndex(const float* bounds, float x) {
  int lo = 0, hi = 255;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (bounds[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

__device__ float BlockMax(float x, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

__global__ void __launch_bounds__(kEightBitThreads) EightBitKernel(EightBitStep s) {
  __shared__ float code1[256], code2[256], bounds1[256], bounds2[256];
  __shared__ float max1[kWarps], max2[kWarps];
  __shared__ int64_t owner;
  const int t = threadIdx.x;
  const int64_t block = blockIdx.x;
  if (t == 0) {
    // The parameter whose blocks hold this one: the last first_block <= block.
    int64_t lo = 0, hi = s.count - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) >> 1;
      if (s.first_block[mid] <= block)
        lo = mid;
      else
        hi = mid - 1;
    }
    owner = lo;
  }
  code1[t] = s.code1[t];
  code2[t] = s.code2[t];
  if (t < 255) {
    bounds1[t] = s.bounds1[t];
    bounds2[t] = s.bounds2[t];
  }
  __syncthreads();
  const int64_t p = owner;
  const float* grad = s.grads[p];
  if (grad == nullptr) return;  // every thread of the block alike: no gradient, no step
  const int64_t local = (block - s.first_block[p]) * kEightBitThreads + t;
  const bool valid = local < s.numel[p];
  const float g = valid ? grad[local] : 0.0f;  // a parameter's last block is padded with zeros
  const int64_t e = block * kEightBitThreads + t;
  float m = code1[s.q1[e]] * s.absmax1[block];
  float v = code2[s.q2[e]] * s.absmax2[block];
  m = m * s.beta1 + (1.0f - s.beta1) * g;
  v = v * s.beta2 + (1.0f - s.beta2) * g * g;
  const float new1 = BlockMax(fabsf(m), max1);
  const float new2 = BlockMax(v, max2);
  if (valid) {
    float* param = s.params[p] + local;
    float value = *param + (m / (sqrtf(v) + s.eps)) * s.step_size;
    if (s.decay != 1.0f) value *= s.decay;
    *param = value;
  }
  int i1 = NearestIndex(bounds1, m / fmaxf(new1, FLT_MIN));
  // The first moment keeps its sign (entry 127 is 0).
  if (m > 0 && i1 < 127) ++i1;
  if (m < 0 && i1 >= 127) --i1;
  const int i2 = NearestIndex(bounds2, v / fmaxf(new2, FLT_MIN));
  s.q1[e] = static_cast<uint8_t>(i1);
  s.q2[e] = static_cast<uint8_t>(i2);
  if (t == 0) {
    // Every thread read the old maxima before BlockMax's barrier.
    s.absmax1[block] = new1;
    s.absmax2[block] = new2;
  }
}

}  // namespace

void EightBitAdamWStep(const EightBitStep& step, cudaStream_t stream) {
  if (step.blocks == 0 || step.count == 0) return;
  EightBitKernel<<<static_cast<unsigned>(step.blocks), kEightBitThreads, 0, stream>>>(step);
}

}  // namespace lorastream::worker::cuda
