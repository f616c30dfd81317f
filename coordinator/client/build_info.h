// How this build of lorastream was made (CUDA or CPU, which LibTorch), read by the torch-free
// `lorastream` so that `up` and `doctor` can tell a CPU-only build from a CUDA one, and the
// one-line refusal a CPU-only build gives where CUDA devices are asked for.
#pragma once

#include <string>
#include <vector>

namespace lorastream::client {

struct BuildInfo {
  bool cuda = false;             // the worker has its CUDA backend
  std::string libtorch_version;  // "2.11.0"; "" when built without the worker
  std::string libtorch_dir;      // the folder CMake found LibTorch in
  std::string cuda_version;      // the CUDA toolkit's, "" on a CPU build
};

const BuildInfo& ThisBuild();

// "LibTorch 2.11.0, CUDA 13.0" or "LibTorch 1.13.1, CPU only".
std::string BuildSummary(const BuildInfo& build = ThisBuild());

// "" when `build` can serve `devices`; else one line saying that this CPU-only build cannot
// use the CUDA devices asked for (naming how many GPUs the host has, `gpus_on_host`) and the
// fix: rebuild with tools/setup.sh, or use CPU workers. On a CPU-only build, a device that is
// none of cpu, cuda, cuda:N is an Error(kInvalidArgument) (ParseDevice, common/base/device.h).
std::string CudaBuildProblem(const std::vector<std::string>& devices, size_t gpus_on_host,
                             const BuildInfo& build = ThisBuild());

}  // namespace lorastream::client
