#include "worker/stream/cuda/cuda_memory.h"

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/base/error.h"

namespace lorastream::worker {

uint64_t CudaPeakAllocatedBytes(int device_index) {
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  return static_cast<uint64_t>(stats.allocated_bytes[0].peak);  // [0]: all pools
}

uint64_t CudaAllocatedBytes(int device_index) {
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  return static_cast<uint64_t>(stats.allocated_bytes[0].current);
}

CudaAllocatorCounters CudaAllocatorCountersNow(int device_index) {
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  CudaAllocatorCounters c;
  c.device_allocs = stats.num_device_alloc;
  c.device_frees = stats.num_device_free;
  c.retries = stats.num_alloc_retries;
  c.syncs = stats.num_sync_all_streams;
  c.segments = stats.segment[0].current;
  return c;
}

namespace {

// cudaMemGetInfo on `device_index`: {free, total} bytes.
std::pair<uint64_t, uint64_t> MemoryInfo(int device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (e != cudaSuccess)
    throw Error(ErrorCode::kUnsupported, "cudaMemGetInfo on cuda:" + std::to_string(device_index) +
                                             ": " + cudaGetErrorString(e));
  return {free_bytes, total_bytes};
}

}  // namespace

uint64_t CudaFreeBytes(int device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  c10::cuda::CUDACachingAllocator::emptyCache();
  return MemoryInfo(device_index).first;
}

uint64_t CudaTotalBytes(int device_index) { return MemoryInfo(device_index).second; }

void CudaResetPeakAllocated(int device_index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
}

}  // namespace lorastream::worker
