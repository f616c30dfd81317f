// The tokenizer a store's manifest records, as DataTokenizerProblem (common/formats/tokenizer_id.h)
// asks for a model's: `lorastream submit` and the trainer check a job's data against it.
#pragma once

#include <optional>

#include "common/formats/manifest.h"
#include "common/formats/tokenizer_id.h"

namespace lorastream {

// nullopt when the checkpoint folder the store was loaded from had no tokenizer.
inline std::optional<TokenizerId> ManifestTokenizer(const Manifest& manifest) {
  if (manifest.tokenizer.fingerprint.empty()) return std::nullopt;
  return manifest.tokenizer;
}

}  // namespace lorastream
