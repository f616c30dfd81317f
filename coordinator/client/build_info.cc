#include "coordinator/client/build_info.h"

#include "common/base/device.h"
#include "lorastream_build_config.h"  // generated into the build folder

namespace lorastream::client {

const BuildInfo& ThisBuild() {
  static const BuildInfo info{LORASTREAM_BUILD_CUDA != 0, LORASTREAM_BUILD_LIBTORCH_VERSION,
                              LORASTREAM_BUILD_LIBTORCH_DIR, LORASTREAM_BUILD_CUDA_VERSION};
  return info;
}

std::string BuildSummary(const BuildInfo& build) {
  std::string s = build.libtorch_version.empty() ? std::string("no LibTorch (no worker)")
                                                 : "LibTorch " + build.libtorch_version;
  return s + (build.cuda ? ", CUDA " + build.cuda_version : std::string(", CPU only"));
}

std::string CudaBuildProblem(const std::vector<std::string>& devices, size_t gpus_on_host,
                             const BuildInfo& build) {
  if (build.cuda) return "";
  std::string asked;
  for (const std::string& d : devices)
    if (ParseDevice(d).is_cuda()) asked += (asked.empty() ? "" : ", ") + d;
  if (asked.empty()) return "";
  const std::string host =
      gpus_on_host > 0 ? "this machine has " + std::to_string(gpus_on_host) + " NVIDIA GPU(s)"
                       : "this machine shows no NVIDIA GPU";
  return "this build is CPU-only (" + BuildSummary(build) + ") and cannot use " + asked + "; " +
         host +
         ": rebuild for CUDA with `tools/setup.sh` (it picks python3's CUDA torch, or "
         "set LORASTREAM_LIBTORCH=DIR), or use CPU workers (--device cpu)";
}

}  // namespace lorastream::client
