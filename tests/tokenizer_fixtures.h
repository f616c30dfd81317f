// The tokenizer fixtures of tests/fixtures/tokenizers/ (made with Python transformers by
// tools/fixtures/make_tokenizer_fixtures.py), for the common and coordinator tests of
// `lorastream prepare` and tokenizer fingerprints. Torch-free.
#pragma once

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace lorastream::testing {

inline const std::filesystem::path& TokenizerFixtures() {
  static const std::filesystem::path dir =
      std::filesystem::path(LORASTREAM_SOURCE_DIR) / "tests/fixtures/tokenizers";
  return dir;
}

inline nlohmann::json ReadJsonFile(const std::filesystem::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

}  // namespace lorastream::testing
