#include "tests/support/test_support.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <vector>

#include "common/base/error.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/checkpoint_manifest.h"
#include "common/formats/safetensors.h"
#include "common/formats/trainer_state_meta.h"
#include "common/posix/remove_tree.h"

namespace lorastream::testing {

TempDir::TempDir(const std::string& tag) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / ("lorastream-" + tag + "-XXXXXX")).string();
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (::mkdtemp(buffer.data()) == nullptr) ThrowErrno("mkdtemp(" + pattern + ")");
  str_ = buffer.data();
  path_ = str_;
}

TempDir::TempDir(TempDir&& other) noexcept
    : path_(std::move(other.path_)), str_(std::move(other.str_)) {
  other.path_.clear();
  other.str_.clear();
}

TempDir::~TempDir() {
  if (str_.empty() || std::getenv("LORASTREAM_KEEP_TEST_DIRS") != nullptr) return;
  RemoveTree(str_);  // not std::filesystem::remove_all: common/posix/remove_tree.h says why
}

bool WaitFor(const std::function<bool()>& done, double timeout_s, int poll_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
  }
  return done();
}

std::string Bin(const std::string& name) {
  const std::string path = std::string(LORASTREAM_BIN_DIR) + "/" + name;
  if (!std::filesystem::exists(path))
    throw Error(ErrorCode::kNotFound, path + " is missing: build the `" + name + "` target");
  return path;
}

std::filesystem::path WriteTestCheckpoint(const std::filesystem::path& out, int64_t step,
                                          double eval_loss, int64_t recorded_step) {
  namespace fs = std::filesystem;
  const fs::path tmp = out / ("." + CheckpointFolderName(step) + ".tmp");
  fs::create_directories(tmp);
  std::ofstream(tmp / "adapter_config.json") << "{\"r\": 4}";
  std::vector<float> weights(64, 0.5f + static_cast<float>(step));
  WriteSafetensors((tmp / "adapter_model.safetensors").string(),
                   {{"lora_A", DType::kF32, {8, 8}, weights.data()}}, {});
  TrainerStateMeta meta;
  meta.step = recorded_step >= 0 ? recorded_step : step;
  meta.samples_seen = step * 4;
  meta.seed = 3;
  meta.fingerprint = "rank=4";
  meta.eval_loss = eval_loss;
  WriteSafetensors((tmp / kTrainerStateFile).string(),
                   {{"exp_avg.lora_A", DType::kF32, {8, 8}, weights.data()}},
                   TrainerStateMetadata(meta));
  WriteCheckpointManifest(tmp.string());
  const fs::path final_dir = out / CheckpointFolderName(step);
  fs::rename(tmp, final_dir);
  return final_dir;
}

bool WriteFaults(const uint8_t* byte) {
  const pid_t child = ::fork();
  if (child < 0) return false;
  if (child == 0) {
    std::signal(SIGSEGV, SIG_DFL);
    *const_cast<volatile uint8_t*>(byte) = 1;
    ::_exit(0);
  }
  int status = 0;
  if (::waitpid(child, &status, 0) != child) return false;
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
}

bool HaveNode() {
  if (const char* env = std::getenv("LORASTREAM_NODE"); env && *env) return true;
  return std::system("command -v node >/dev/null 2>&1 || command -v nodejs >/dev/null 2>&1") == 0;
}
}  // namespace lorastream::testing
