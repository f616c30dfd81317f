#include "worker/train_state.h"

#include <filesystem>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/remove_tree.h"
#include "common/safetensors.h"
#include "worker/base_weights.h"

namespace lorastream {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStateFile = "trainer_state.safetensors";

// checkpoint-<N> -> N, -1 for other names.
int64_t CheckpointStep(const std::string& name) {
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  int64_t n = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || n > (int64_t{1} << 50)) return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

}  // namespace

std::string SaveCheckpoint(const std::string& output_dir, const LoraAdapter& adapter,
                           AdamW& optimizer, const TrainState& state,
                           const std::string& base_model) {
  const fs::path final_dir = fs::path(output_dir) / ("checkpoint-" + std::to_string(state.step));
  const fs::path tmp_dir = fs::path(output_dir) / (".checkpoint-" + std::to_string(state.step) + ".tmp");
  std::error_code ec;
  RemoveTree(tmp_dir.string());  // never std::filesystem::remove_all here: common/remove_tree.h
  adapter.Save(tmp_dir.string(), base_model);

  std::vector<at::Tensor> host;
  std::vector<TensorToWrite> tensors;
  const auto names = adapter.ParamNames();
  LS_CHECK(names.size() == optimizer.exp_avg().size(), "optimizer and adapter differ");
  for (int which = 0; which < 2; ++which) {
    auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
    for (size_t i = 0; i < names.size(); ++i) {
      host.push_back(moments[i].detach().to(at::kCPU, at::kFloat).contiguous());
      TensorToWrite t;
      t.name = (which == 0 ? "exp_avg." : "exp_avg_sq.") + names[i];
      t.dtype = DType::kF32;
      t.shape = host.back().sizes().vec();
      t.data = host.back().data_ptr();
      tensors.push_back(t);
    }
  }
  WriteSafetensors((tmp_dir / kStateFile).string(), tensors,
                   {{"format", "lorastream-trainer-state"},
                    {"version", "1"},
                    {"step", std::to_string(state.step)},
                    {"samples_seen", std::to_string(state.samples_seen)},
                    {"seed", std::to_string(state.seed)},
                    {"fingerprint", state.fingerprint}});
  RemoveTree(final_dir.string());
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot rename " + tmp_dir.string() + ": " + ec.message());
  // Only now that the new one is complete: drop the older checkpoints.
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    const int64_t step = CheckpointStep(entry.path().filename().string());
    if (step >= 0 && step != state.step) RemoveTree(entry.path().string());
  }
  return final_dir.string();
}

std::string FindLatestCheckpoint(const std::string& output_dir) {
  std::error_code ec;
  std::string best;
  int64_t best_step = -1;
  if (!fs::is_directory(output_dir, ec)) return best;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    const int64_t step = CheckpointStep(entry.path().filename().string());
    if (step > best_step && fs::is_regular_file(entry.path() / kStateFile, ec) &&
        fs::is_regular_file(entry.path() / "adapter_model.safetensors", ec)) {
      best_step = step;
      best = entry.path().string();
    }
  }
  return best;
}

TrainState LoadTrainerState(const std::string& dir, const LoraAdapter& adapter,
                            AdamW& optimizer) {
  const std::string path = (fs::path(dir) / kStateFile).string();
  SafetensorsFile file = SafetensorsFile::Open(path);
  const auto& meta = file.header().metadata;
  auto field = [&](const char* key) -> std::string {
    auto it = meta.find(key);
    if (it == meta.end())
      throw Error(ErrorCode::kCorrupt, path + ": metadata `" + key + "` is missing");
    return it->second;
  };
  if (field("format") != "lorastream-trainer-state" || field("version") != "1")
    throw Error(ErrorCode::kCorrupt, path + ": not a version 1 lorastream trainer state");
  TrainState s;
  try {
    s.step = std::stoll(field("step"));
    s.samples_seen = std::stoll(field("samples_seen"));
    s.seed = std::stoull(field("seed"));
  } catch (const std::logic_error&) {
    throw Error(ErrorCode::kCorrupt, path + ": step/samples_seen/seed are not numbers");
  }
  s.fingerprint = field("fingerprint");
  const auto names = adapter.ParamNames();
  for (int which = 0; which < 2; ++which) {
    auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string key = (which == 0 ? "exp_avg." : "exp_avg_sq.") + names[i];
      const SafetensorsEntry* e = file.Find(key);
      if (!e || e->dtype != DType::kF32 || e->shape != moments[i].sizes().vec())
        throw Error(ErrorCode::kCorrupt, path + ": tensor `" + key +
                                             "` is missing or has the wrong dtype/shape");
      at::Tensor view = at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape,
                                      at::TensorOptions().dtype(at::kFloat));
      moments[i].copy_(view);
    }
  }
  optimizer.set_step(s.step);
  return s;
}

}  // namespace lorastream
