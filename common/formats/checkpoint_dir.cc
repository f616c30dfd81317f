#include "common/formats/checkpoint_dir.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/checkpoint_manifest.h"
#include "common/formats/safetensors.h"
#include "common/posix/durable_file.h"
#include "common/posix/remove_tree.h"

namespace lorastream {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = "checkpoint-";

// A complete checkpoint's trainer-state metadata, without checksums; nullopt when the
// folder has no usable manifest or trainer state.
std::optional<TrainerStateMeta> ReadCompleteCheckpoint(const CheckpointEntry& c,
                                                       const std::vector<std::string>& required) {
  try {
    ReadCheckpointManifest(c.dir, required);
    const std::string state = (fs::path(c.dir) / kTrainerStateFile).string();
    return ParseTrainerStateMetadata(SafetensorsFile::Open(state).header().metadata, state);
  } catch (const Error&) {
    return std::nullopt;
  }
}

// OUTPUT_DIR/best/ made a copy of `best`'s adapter files, unless it is one already.
void PublishBestAdapter(const std::string& output_dir, const CheckpointEntry& best,
                        double eval_loss) {
  const fs::path dir = fs::path(output_dir) / kBestAdapterFolder;
  const std::string name = fs::path(best.dir).filename().string();
  const nlohmann::json note{{"checkpoint", name}, {"step", best.step}, {"eval_loss", eval_loss}};
  std::error_code ec;
  if (fs::exists(dir / kBestAdapterNote, ec)) {
    try {
      std::ifstream in(dir / kBestAdapterNote);
      if (nlohmann::json::parse(in).value("checkpoint", "") == name) return;
    } catch (const std::exception&) {
      // unreadable: written afresh below
    }
  }
  const fs::path tmp = fs::path(output_dir) / (std::string(".") + kBestAdapterFolder + ".tmp");
  const fs::path old = fs::path(output_dir) / (std::string(".") + kBestAdapterFolder + ".old");
  RemoveTree(tmp.string());
  RemoveTree(old.string());
  fs::create_directories(tmp, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot create " + tmp.string() + ": " + ec.message());
  for (const auto& entry : fs::directory_iterator(best.dir)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_regular_file() || file == kTrainerStateFile || file == kCheckpointManifestFile)
      continue;
    fs::copy_file(entry.path(), tmp / file, ec);
    if (ec)
      throw Error(ErrorCode::kIo, "cannot copy " + entry.path().string() + ": " + ec.message());
  }
  WriteFileDurably((tmp / kBestAdapterNote).string(), note.dump(2) + "\n");
  FsyncFolder(tmp.string());
  if (fs::exists(dir, ec)) fs::rename(dir, old, ec);
  fs::rename(tmp, dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot rename " + tmp.string() + ": " + ec.message());
  FsyncPath(output_dir);
  RemoveTree(old.string());
}

}  // namespace

std::string BestAdapterDir(const std::string& output_dir) {
  const fs::path dir = fs::path(output_dir) / kBestAdapterFolder;
  std::error_code ec;
  return fs::is_regular_file(dir / kBestAdapterNote, ec) ? dir.string() : "";
}

const std::vector<std::string>& CheckpointRequiredFiles() {
  static const std::vector<std::string> names = {"adapter_model.safetensors", "adapter_config.json",
                                                 kTrainerStateFile};
  return names;
}

std::string CheckpointFolderName(int64_t step) { return kPrefix + std::to_string(step); }

int64_t CheckpointStepOf(const std::string& name) {
  const std::string prefix = kPrefix;
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() ||
      name.size() > prefix.size() + 18)
    return -1;
  int64_t n = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return CheckpointFolderName(n) == name ? n : -1;  // no leading zeros: one name per step
}

std::vector<CheckpointEntry> ListCheckpoints(const std::string& output_dir) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    const int64_t step = CheckpointStepOf(entry.path().filename().string());
    if (step >= 0 && entry.is_directory(ec) && !entry.is_symlink(ec))
      out.push_back({step, entry.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step > b.step; });
  return out;
}

void RemoveStaleCheckpointTemporaries(const std::string& output_dir) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 5 && name[0] == '.' && name.compare(name.size() - 4, 4, ".tmp") == 0 &&
        CheckpointStepOf(name.substr(1, name.size() - 5)) >= 0)
      stale.push_back(entry.path());
  }
  for (const auto& path : stale) {
    LS_LOG_WARN("removing {}: an unfinished checkpoint left by an interrupted save", path.string());
    RemoveTree(path.string());
  }
}

TrainerStateMeta VerifyCheckpoint(const CheckpointEntry& c,
                                  const std::vector<std::string>& required) {
  VerifyCheckpointFiles(c.dir, required);
  const std::string state = (fs::path(c.dir) / kTrainerStateFile).string();
  TrainerStateMeta meta =
      ParseTrainerStateMetadata(SafetensorsFile::Open(state).header().metadata, state);
  if (meta.step != c.step)
    throw Error(ErrorCode::kCorrupt, state + ": records step " + std::to_string(meta.step) +
                                         " in a folder named " + CheckpointFolderName(c.step));
  return meta;
}

std::string FindResumableCheckpoint(const std::string& output_dir,
                                    const std::vector<std::string>& required) {
  const auto checkpoints = ListCheckpoints(output_dir);
  std::string faults;
  for (const auto& c : checkpoints) {
    try {
      VerifyCheckpoint(c, required);
      if (!faults.empty())
        LS_LOG_WARN("resuming from {}, the newest checkpoint that verifies", c.dir);
      return c.dir;
    } catch (const Error& e) {
      LS_LOG_WARN("checkpoint {} is damaged and is not used: {}", c.dir, e.what());
      faults += "\n  " + std::string(e.what());
    }
  }
  if (!checkpoints.empty())
    throw Error(ErrorCode::kCorrupt,
                output_dir +
                    ": no usable checkpoint to resume from (restore one, or use another "
                    "train.output_dir to start afresh):" +
                    faults);
  return "";
}

std::string FindBestCheckpoint(const std::string& output_dir) {
  std::string best;
  double best_loss = 0;
  for (const auto& c : ListCheckpoints(output_dir)) {
    auto meta = ReadCompleteCheckpoint(c, CheckpointRequiredFiles());
    if (meta && std::isfinite(meta->eval_loss) && (best.empty() || meta->eval_loss < best_loss)) {
      best = c.dir;
      best_loss = meta->eval_loss;
    }
  }
  return best;
}

void PruneCheckpoints(const std::string& output_dir, int64_t current_step, int64_t keep,
                      bool keep_best, const std::vector<std::string>& required) {
  LS_CHECK(keep >= 1, "keep_checkpoints must be >= 1");
  std::set<std::string> kept;
  std::optional<CheckpointEntry> best;
  double best_loss = 0;
  int64_t complete = 0;
  const auto checkpoints = ListCheckpoints(output_dir);
  for (const auto& c : checkpoints) {  // newest first
    if (c.step > current_step) continue;
    auto meta = ReadCompleteCheckpoint(c, required);
    if (!meta) continue;
    if (complete++ < keep) kept.insert(c.dir);
    if (std::isfinite(meta->eval_loss) && (!best || meta->eval_loss < best_loss)) {
      best = c;
      best_loss = meta->eval_loss;
    }
  }
  if (keep_best && best) {
    kept.insert(best->dir);
    PublishBestAdapter(output_dir, *best, best_loss);
  }
  for (const auto& c : checkpoints)
    if (!kept.count(c.dir)) RemoveTree(c.dir);
}

std::string PublishCheckpoint(const std::string& output_dir, int64_t step,
                              const std::function<void(const std::string& tmp_dir)>& write_files,
                              int64_t keep, bool keep_best,
                              const std::vector<std::string>& required) {
  const std::string name = CheckpointFolderName(step);
  const fs::path final_dir = fs::path(output_dir) / name;
  const fs::path tmp_dir = fs::path(output_dir) / ("." + name + ".tmp");
  std::error_code ec;
  fs::create_directories(output_dir, ec);
  RemoveStaleCheckpointTemporaries(output_dir);
  fs::create_directories(tmp_dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot create " + tmp_dir.string() + ": " + ec.message());
  write_files(tmp_dir.string());
  WriteCheckpointManifest(tmp_dir.string());  // last; fsyncs every file and the folder
  RemoveTree(
      final_dir.string());  // never std::filesystem::remove_all here: common/posix/remove_tree.h
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot rename " + tmp_dir.string() + ": " + ec.message());
  FsyncPath(output_dir);  // the rename itself survives a power loss only now
  // Only now that the new one is complete: drop the checkpoints retention does not keep.
  PruneCheckpoints(output_dir, step, keep, keep_best, required);
  return final_dir.string();
}

}  // namespace lorastream
