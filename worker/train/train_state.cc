#include "worker/train/train_state.h"

#include <filesystem>

#include <ATen/ATen.h>

#include "common/checkpoint_dir.h"
#include "common/checkpoint_manifest.h"
#include "common/error.h"
#include "common/safetensors.h"
#include "worker/model/base_weights.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

std::string SaveCheckpoint(const std::string& output_dir, const LoraAdapter& adapter,
                           AdamW& optimizer, const TrainState& state, const std::string& base_model,
                           const CheckpointRetention& retention) {
  auto write_files = [&](const std::string& tmp_dir) {
    adapter.Save(tmp_dir, base_model);
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
    TrainerStateMeta meta;
    meta.step = state.step;
    meta.samples_seen = state.samples_seen;
    meta.seed = state.seed;
    meta.fingerprint = state.fingerprint;
    meta.eval_loss = state.eval_loss;
    WriteSafetensors((fs::path(tmp_dir) / kTrainerStateFile).string(), tensors,
                     TrainerStateMetadata(meta));
  };
  return PublishCheckpoint(output_dir, state.step, write_files, retention.keep,
                           retention.keep_best);
}

std::string FindLatestCheckpoint(const std::string& output_dir) {
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return "";
  RemoveStaleCheckpointTemporaries(output_dir);
  return FindResumableCheckpoint(output_dir);
}

TrainState LoadTrainerState(const std::string& dir, const LoraAdapter& adapter, AdamW& optimizer) {
  const std::string path = (fs::path(dir) / kTrainerStateFile).string();
  SafetensorsFile file = SafetensorsFile::Open(path);
  const TrainerStateMeta meta = ParseTrainerStateMetadata(file.header().metadata, path);
  TrainState s;
  s.step = meta.step;
  s.samples_seen = meta.samples_seen;
  s.seed = meta.seed;
  s.fingerprint = meta.fingerprint;
  s.eval_loss = meta.eval_loss;
  const auto names = adapter.ParamNames();
  for (int which = 0; which < 2; ++which) {
    auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string key = (which == 0 ? "exp_avg." : "exp_avg_sq.") + names[i];
      const SafetensorsEntry* e = file.Find(key);
      if (!e || e->dtype != DType::kF32 || e->shape != moments[i].sizes().vec())
        throw Error(ErrorCode::kCorrupt,
                    path + ": tensor `" + key + "` is missing or has the wrong dtype/shape");
      at::Tensor view = at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape,
                                      at::TensorOptions().dtype(at::kFloat));
      moments[i].copy_(view);
    }
  }
  optimizer.set_step(s.step);
  return s;
}

}  // namespace lorastream::worker
