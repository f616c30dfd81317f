// Where the running executable and its data files are, so that every lorastream command works
// from any folder: in the build tree (build/bin/, data in the source tree's configs/) and
// installed by `cmake --install` (PREFIX/bin/, data in PREFIX/share/lorastream/configs/).
#pragma once

#include <string>

namespace lorastream {

// The folder of the running executable (from /proc/self/exe); "" when it cannot be read.
std::string SelfExeDir();

// The configs/ folder (models/ presets, jobs/ examples, data/): $LORASTREAM_CONFIGS_DIR when
// set, else SelfExeDir()/../share/lorastream/configs when it exists (an installed prefix),
// else the source tree's configs/ this build was made from. Throws Error(kNotFound) naming
// the places it looked when none exists.
std::string ConfigsDir();

}  // namespace lorastream
