#include "worker/cuda/cuda_memory.h"

#include <c10/cuda/CUDACachingAllocator.h>

namespace lorastream::worker {

uint64_t CudaPeakAllocatedBytes(int device_index) {
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  return static_cast<uint64_t>(stats.allocated_bytes[0].peak);  // [0]: all pools
}

void CudaResetPeakAllocated(int device_index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
}

}  // namespace lorastream::worker
