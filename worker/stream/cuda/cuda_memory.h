// Peak device memory from LibTorch's CUDA caching allocator (header free of CUDA and torch:
// the benchmark uses it for providers that do not report it themselves).
#pragma once

#include <cstdint>

namespace lorastream::worker {

uint64_t CudaPeakAllocatedBytes(int device_index);
// The bytes the caching allocator has handed out and not taken back now.
uint64_t CudaAllocatedBytes(int device_index);
void CudaResetPeakAllocated(int device_index);

// The bytes the driver reports free on the device (cudaMemGetInfo) after the caching
// allocator has returned its unused cache to it: what a new job of this process could
// allocate, less what other processes hold.
uint64_t CudaFreeBytes(int device_index);
// The device's whole memory (cudaMemGetInfo's total).
uint64_t CudaTotalBytes(int device_index);

// The caching allocator's own calls to the driver since the process started: cudaMalloc and
// cudaFree of segments, retries after a failed cudaMalloc (each frees the cache, syncing the
// device), and synchronisations of every stream. (A cudaMalloc serialises the device's
// streams: copies stop overlapping compute for it.)
struct CudaAllocatorCounters {
  int64_t device_allocs = 0, device_frees = 0, retries = 0, syncs = 0, segments = 0;
};
CudaAllocatorCounters CudaAllocatorCountersNow(int device_index);

}  // namespace lorastream::worker
