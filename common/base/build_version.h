// What `--version` prints for every executable: lorastream's version, the git commit the build
// was configured at, the LibTorch it was built against and its CUDA toolkit (or CPU only).
// Torch-free: the figures come from CMake (common/CMakeLists.txt), not from LibTorch's headers.
#pragma once

#include <string>

namespace lorastream {

// "lorastream-worker 0.1.0 (commit 3deb393ab1c2)\nLibTorch 1.13.0, CPU only\n"; a build
// without LibTorch (the sanitizer and fuzz builds) says "no LibTorch".
std::string VersionText(const std::string& program);

}  // namespace lorastream
