// One step of AdamW with 8-bit moments (worker/train/adamw.h) as one CUDA kernel over every
// quantisation block of a set of parameters, on raw device pointers (no LibTorch here): a
// CUDA block of kEightBitThreads threads per block of as many elements, which dequantises
// both moments, updates them with the gradient, takes the block's new maxima, updates the
// parameter and rounds the moments back, as the ATen reference path in worker/train/adamw.cc
// does with one operation at a time (the same arithmetic per element; the two differ only
// where the compiler fuses a multiply and an add).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace lorastream::worker::cuda {

inline constexpr int kEightBitThreads = 256;  // = kEightBitBlock

struct EightBitStep {
  // Per parameter (P of them, in the state's order): its first block in the state, its
  // elements, its f32 values and its f32 gradient (null: no gradient this step, skipped).
  const int64_t* first_block = nullptr;  // [P], ascending
  const int64_t* numel = nullptr;        // [P]
  float* const* params = nullptr;        // [P]
  const float* const* grads = nullptr;   // [P]
  int64_t count = 0;                     // P
  int64_t blocks = 0;                    // every parameter's blocks
  uint8_t* q1 = nullptr;                 // [blocks x 256]: the first moment's indices
  uint8_t* q2 = nullptr;                 // the second's
  float* absmax1 = nullptr;              // [blocks]
  float* absmax2 = nullptr;
  const float* code1 = nullptr;    // the signed dynamic map, 256 entries
  const float* code2 = nullptr;    // the unsigned one
  const float* bounds1 = nullptr;  // the 255 midpoints between code1's entries
  const float* bounds2 = nullptr;
  float beta1 = 0.9f, beta2 = 0.999f;
  float eps = 0;        // sqrt(1 - beta2^t) x eps
  float step_size = 0;  // -lr sqrt(1 - beta2^t) / (1 - beta1^t)
  float decay = 1;      // 1 - lr x weight_decay (1: none)
};

void EightBitAdamWStep(const EightBitStep& step, cudaStream_t stream);

}  // namespace lorastream::worker::cuda
