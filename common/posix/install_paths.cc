#include "common/posix/install_paths.h"

#include <cstdlib>
#include <filesystem>

#include "common/base/error.h"

#ifndef LORASTREAM_SOURCE_DIR
#define LORASTREAM_SOURCE_DIR "."
#endif

namespace lorastream {

namespace fs = std::filesystem;

std::string SelfExeDir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : self.parent_path().string();
}

std::string ConfigsDir() {
  if (const char* env = std::getenv("LORASTREAM_CONFIGS_DIR"); env && *env) return env;
  std::error_code ec;
  const std::string self = SelfExeDir();
  std::string installed;
  if (!self.empty()) {
    installed = (fs::path(self).parent_path() / "share/lorastream/configs").string();
    if (fs::is_directory(installed, ec)) return installed;
  }
  const std::string source = std::string(LORASTREAM_SOURCE_DIR) + "/configs";
  if (fs::is_directory(source, ec)) return source;
  throw Error(ErrorCode::kNotFound,
              "lorastream's configs/ folder is neither installed (" +
                  (installed.empty() ? std::string("no /proc/self/exe") : installed) +
                  ") nor in the source tree (" + source +
                  "); install with `cmake --install BUILD --prefix P` or set "
                  "LORASTREAM_CONFIGS_DIR");
}

std::string BundledTokenizerDir(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") return "";
  std::error_code ec;
  const std::string self = SelfExeDir();
  if (!self.empty()) {
    const fs::path installed = fs::path(self).parent_path() / "share/lorastream/tokenizers" / name;
    if (fs::is_regular_file(installed / "tokenizer.json", ec)) return installed.string();
  }
  const fs::path source = fs::path(LORASTREAM_SOURCE_DIR) / "tests/fixtures/tokenizers" / name;
  if (fs::is_regular_file(source / "tokenizer.json", ec)) return source.string();
  return "";
}

}  // namespace lorastream
