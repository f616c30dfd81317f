#include "coordinator/cli/prepare.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>

#include "common/base/error.h"
#include "common/formats/tokenizer_id.h"
#include "common/posix/install_paths.h"
#include "common/posix/subprocess.h"

namespace lorastream::cli {

namespace fs = std::filesystem;

namespace {

// node, or Debian's older name nodejs; $LORASTREAM_NODE overrides.
std::string FindNode() {
  if (const char* env = std::getenv("LORASTREAM_NODE"); env && *env) return env;
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  std::vector<std::string> candidates;
  while (std::getline(dirs, dir, ':')) candidates.push_back(dir);
  for (const char* name : {"node", "nodejs"})
    for (const std::string& d : candidates) {
      const fs::path p = fs::path(d.empty() ? "." : d) / name;
      if (::access(p.c_str(), X_OK) == 0) return p.string();
    }
  throw Error(ErrorCode::kUnsupported,
              "lorastream prepare needs Node.js (>= 18): install Debian's `nodejs` (tools/setup.sh "
              "does) or set LORASTREAM_NODE to a node executable");
}

std::string Number(double v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

}  // namespace

std::string FindPrepareScript() {
  if (const char* env = std::getenv("LORASTREAM_PREPARE_SCRIPT"); env && *env) return env;
  std::error_code ec;
  const std::string self_dir = SelfExeDir();
  std::vector<fs::path> candidates;
  if (!self_dir.empty())
    candidates.push_back(fs::path(self_dir).parent_path() / "share/lorastream/prepare/prepare.mjs");
  candidates.push_back(fs::path(LORASTREAM_SOURCE_DIR) / "tools/prepare/prepare.mjs");
  for (const fs::path& p : candidates)
    if (fs::is_regular_file(p, ec)) return p.string();
  std::string tried;
  for (const fs::path& p : candidates) tried += " " + p.string();
  throw Error(ErrorCode::kUnsupported,
              "lorastream prepare: its script prepare.mjs is missing (looked at" + tried +
                  "); set LORASTREAM_PREPARE_SCRIPT to tools/prepare/prepare.mjs of the sources");
}

int RunPrepare(const PrepareOptions& o) {
  std::error_code ec;
  if (!fs::is_directory(o.model_dir, ec))
    throw Error(ErrorCode::kNotFound, "--model " + o.model_dir + " is not a folder");
  std::optional<TokenizerId> tokenizer = ModelTokenizerId(o.model_dir);
  if (!tokenizer)
    throw Error(ErrorCode::kNotFound,
                "--model " + o.model_dir +
                    " has no tokenizer.json: prepare needs the model "
                    "folder's Hugging Face tokenizer (tokenizer.json and tokenizer_config.json)");
  for (const std::string& in : o.inputs)
    if (!fs::is_regular_file(in, ec))
      throw Error(ErrorCode::kNotFound, "--in " + in + ": no such file");
  std::vector<std::string> argv = {FindNode(),
                                   FindPrepareScript(),
                                   "--model",
                                   o.model_dir,
                                   "--format",
                                   o.format,
                                   "--out",
                                   o.out,
                                   "--val-split",
                                   Number(o.val_split),
                                   "--seq-len",
                                   std::to_string(o.seq_len),
                                   "--seed",
                                   std::to_string(o.seed),
                                   "--fingerprint",
                                   tokenizer->fingerprint,
                                   "--tokenizer-name",
                                   tokenizer->name};
  for (const std::string& in : o.inputs) {
    argv.push_back("--in");
    argv.push_back(in);
  }
  if (o.train_on_all) argv.push_back("--train-on-all");
  if (o.force) argv.push_back("--force");
  Subprocess child = Subprocess::Spawn(argv);
  const int status = child.Wait();
  // The script ends with one of lorastream's statuses, having said why; anything else is node
  // itself failing (out of memory, a fatal error, a signal), whose own words may be a stack
  // trace: say what happened in lorastream's.
  if (status >= 0 && status <= 5) return status;
  throw Error(ErrorCode::kInternal,
              "lorastream prepare: node (" + argv[0] + ") ended " +
                  (status > 128 ? "by signal " + std::to_string(status - 128)
                                : "with status " + std::to_string(status)) +
                  " while tokenizing " + o.inputs.front() + (o.inputs.size() > 1 ? " ..." : "") +
                  " (a chat template or an input too large for node's memory ends this way)");
}

}  // namespace lorastream::cli
