#include "worker/stream/cuda/cuda_bandwidth.h"

#include <algorithm>
#include <string>

#include <cuda_runtime_api.h>

#include "common/base/error.h"
#include "worker/stream/cuda/cuda_handles.h"

namespace lorastream::worker {

double MeasurePinnedH2DBandwidth(const std::vector<std::pair<const uint8_t*, uint64_t>>& ranges,
                                 int device_index, int repeats) {
  LS_CHECK(!ranges.empty() && repeats > 0, "nothing to measure");
  CudaCheck(cudaSetDevice(device_index), "cudaSetDevice");
  std::vector<HostRegistration> registrations(ranges.size());
  uint64_t largest = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    std::string error;
    if (!registrations[i].Register(ranges[i].first, ranges[i].second, &error)) {
      throw Error(ErrorCode::kResource, "bandwidth: cudaHostRegister failed: " + error);
    }
    largest = std::max(largest, ranges[i].second);
  }
  DeviceBuffer dst(largest);
  CudaStream stream;
  CudaEvent start(true), end(true);
  auto pass = [&] {
    for (const auto& [src, bytes] : ranges) {
      CudaCheck(cudaMemcpyAsync(dst.get(), src, bytes, cudaMemcpyHostToDevice, stream.get()),
                "cudaMemcpyAsync");
    }
  };
  pass();  // warm-up: first-touch costs are not bandwidth
  CudaCheck(cudaEventRecord(start.get(), stream.get()), "cudaEventRecord");
  uint64_t total = 0;
  for (int r = 0; r < repeats; ++r) {
    pass();
    for (const auto& range : ranges) total += range.second;
  }
  CudaCheck(cudaEventRecord(end.get(), stream.get()), "cudaEventRecord");
  CudaCheck(cudaEventSynchronize(end.get()), "cudaEventSynchronize");
  float ms = 0;
  CudaCheck(cudaEventElapsedTime(&ms, start.get(), end.get()), "cudaEventElapsedTime");
  return static_cast<double>(total) / (ms / 1e3) / 1e9;
}

}  // namespace lorastream::worker
