// Peak device memory from LibTorch's CUDA caching allocator (header free of CUDA and torch:
// the benchmark uses it for providers that do not report it themselves).
#pragma once

#include <cstdint>

namespace lorastream::worker {

uint64_t CudaPeakAllocatedBytes(int device_index);
void CudaResetPeakAllocated(int device_index);

}  // namespace lorastream::worker
