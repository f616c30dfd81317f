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

// The folder of a small Hugging Face tokenizer bundled with lorastream (`name`: "llama3"), as
// the README's walk-through gives `lorastream-synth --tokenizer llama3`: installed, it is
// SelfExeDir()/../share/lorastream/tokenizers/NAME; in the build tree, the source tree's test
// fixture tests/fixtures/tokenizers/NAME. "" when neither exists.
std::string BundledTokenizerDir(const std::string& name);

}  // namespace lorastream
