#include "worker/train/train_state.h"

#include <filesystem>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/checkpoint_manifest.h"
#include "common/formats/safetensors.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

namespace {

const char* MomentPrefix(int which) { return which == 0 ? "exp_avg." : "exp_avg_sq."; }

}  // namespace

std::string SaveCheckpoint(const std::string& output_dir, const FamilyJob& job, AdamW& optimizer,
                           const TrainState& state, const CheckpointRetention& retention,
                           const std::vector<std::string>& files) {
  auto write_files = [&](const std::string& tmp_dir) {
    job.SaveAdapter(tmp_dir);
    std::vector<at::Tensor> host;
    std::vector<TensorToWrite> tensors;
    const auto names = job.ParamNames();
    LS_CHECK(names.size() == optimizer.exp_avg().size(), "optimizer and adapter differ");
    for (int which = 0; which < 2; ++which) {
      auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
      for (size_t i = 0; i < names.size(); ++i) {
        host.push_back(moments[i].detach().to(at::kCPU, at::kFloat).contiguous());
        tensors.push_back({MomentPrefix(which) + names[i], DType::kF32, host.back().sizes().vec(),
                           host.back().data_ptr()});
      }
    }
    WriteSafetensors((fs::path(tmp_dir) / kTrainerStateFile).string(), tensors,
                     TrainerStateMetadata(state));
  };
  return PublishCheckpoint(output_dir, state.step, write_files, retention.keep, retention.keep_best,
                           files);
}

std::string FindLatestCheckpoint(const std::string& output_dir,
                                 const std::vector<std::string>& files) {
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return "";
  RemoveStaleCheckpointTemporaries(output_dir);
  return FindResumableCheckpoint(output_dir, files);
}

TrainState ReadTrainerState(const std::string& dir) {
  const std::string path = (fs::path(dir) / kTrainerStateFile).string();
  const SafetensorsFile file = SafetensorsFile::Open(path);
  return ParseTrainerStateMetadata(file.header().metadata, path);
}

void LoadOptimizerState(const std::string& dir, const std::vector<std::string>& names, int64_t step,
                        AdamW& optimizer) {
  const std::string path = (fs::path(dir) / kTrainerStateFile).string();
  const SafetensorsFile file = SafetensorsFile::Open(path);
  LS_CHECK(names.size() == optimizer.exp_avg().size(), "optimizer and adapter differ");
  for (int which = 0; which < 2; ++which) {
    auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string key = MomentPrefix(which) + names[i];
      const SafetensorsEntry* e = file.Find(key);
      if (!e || e->dtype != DType::kF32 || e->shape != moments[i].sizes().vec())
        throw Error(ErrorCode::kCorrupt,
                    path + ": tensor `" + key + "` is missing or has the wrong dtype/shape");
      moments[i].copy_(at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape,
                                     at::TensorOptions().dtype(at::kFloat)));
    }
  }
  optimizer.set_step(step);
}

}  // namespace lorastream::worker
