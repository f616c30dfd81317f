#include "common/base/build_version.h"

// Defined for this file alone by common/CMakeLists.txt (a definition on every file would
// rebuild the whole library at each commit); the fallbacks serve a build that gives none.
#ifndef LORASTREAM_VERSION
#define LORASTREAM_VERSION "unknown"
#endif
#ifndef LORASTREAM_GIT_COMMIT
#define LORASTREAM_GIT_COMMIT ""
#endif
#ifndef LORASTREAM_LIBTORCH_VERSION
#define LORASTREAM_LIBTORCH_VERSION ""
#endif
#ifndef LORASTREAM_CUDA_VERSION
#define LORASTREAM_CUDA_VERSION ""
#endif

namespace lorastream {

std::string VersionText(const std::string& program) {
  const std::string commit = LORASTREAM_GIT_COMMIT;
  const std::string torch = LORASTREAM_LIBTORCH_VERSION;
  const std::string cuda = LORASTREAM_CUDA_VERSION;
  return program + " " + LORASTREAM_VERSION +
         (commit.empty() ? std::string(" (commit unknown)") : " (commit " + commit + ")") + "\n" +
         (torch.empty() ? std::string("no LibTorch") : "LibTorch " + torch) +
         (cuda.empty() ? std::string(", CPU only") : ", CUDA " + cuda) + "\n";
}

}  // namespace lorastream
