#include "worker/train/train_state.h"

#include <filesystem>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/checkpoint_manifest.h"
#include "common/formats/safetensors.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

namespace {

const char* MomentPrefix(int which) { return which == 0 ? "exp_avg." : "exp_avg_sq."; }
// An 8-bit moment's block maxima, beside its bytes.
const char* AbsmaxPrefix(int which) {
  return which == 0 ? "exp_avg_absmax." : "exp_avg_sq_absmax.";
}

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
    host.reserve(4 * names.size());  // data pointers into it stay valid
    const auto add = [&](const std::string& key, const at::Tensor& t, at::ScalarType type,
                         DType dtype) {
      host.push_back(t.detach().to(at::kCPU, type).contiguous());
      tensors.push_back({key, dtype, host.back().sizes().vec(), host.back().data_ptr()});
    };
    for (int which = 0; which < 2; ++which) {
      auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
      auto& absmax = which == 0 ? optimizer.exp_avg_absmax() : optimizer.exp_avg_sq_absmax();
      for (size_t i = 0; i < names.size(); ++i) {
        if (optimizer.eight_bit(i)) {
          add(MomentPrefix(which) + names[i], moments[i], at::kByte, DType::kU8);
          add(AbsmaxPrefix(which) + names[i], absmax[i], at::kFloat, DType::kF32);
        } else {
          add(MomentPrefix(which) + names[i], moments[i], at::kFloat, DType::kF32);
        }
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
  c10::NoGradGuard no_grad;
  const std::string path = (fs::path(dir) / kTrainerStateFile).string();
  const SafetensorsFile file = SafetensorsFile::Open(path);
  LS_CHECK(names.size() == optimizer.exp_avg().size(), "optimizer and adapter differ");
  const auto view = [&](const SafetensorsEntry& e, at::ScalarType type) {
    return at::from_blob(const_cast<uint8_t*>(file.Data(e)), e.shape,
                         at::TensorOptions().dtype(type));
  };
  const auto bad = [&](const std::string& key) {
    return Error(ErrorCode::kCorrupt,
                 path + ": tensor `" + key + "` is missing or has the wrong dtype/shape");
  };
  const std::vector<at::Tensor>& params = optimizer.params();
  for (int which = 0; which < 2; ++which) {
    auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
    auto& absmax = which == 0 ? optimizer.exp_avg_absmax() : optimizer.exp_avg_sq_absmax();
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string key = MomentPrefix(which) + names[i];
      const std::string max_key = AbsmaxPrefix(which) + names[i];
      const SafetensorsEntry* e = file.Find(key);
      if (!e) throw bad(key);
      const int64_t n = params[i].numel();
      const int64_t blocks = (n + kEightBitBlock - 1) / kEightBitBlock;
      at::Tensor value;  // the moment in f32 where the file's kind is not the optimizer's
      if (e->dtype == DType::kF32) {
        if (e->shape != params[i].sizes().vec()) throw bad(key);
        value = view(*e, at::kFloat);
      } else {
        // 8-bit: the bytes of whole blocks and their maxima (`optim.type = "adamw8bit"`).
        const SafetensorsEntry* m = file.Find(max_key);
        if (e->dtype != DType::kU8 || e->shape != std::vector<int64_t>{blocks * kEightBitBlock})
          throw bad(key);
        if (!m || m->dtype != DType::kF32 || m->shape != std::vector<int64_t>{blocks})
          throw bad(max_key);
        if (optimizer.eight_bit(i)) {
          moments[i].copy_(view(*e, at::kByte));
          absmax[i].copy_(view(*m, at::kFloat));
          continue;
        }
        value = DequantizeMoment(view(*e, at::kByte), view(*m, at::kFloat), which == 0)
                    .narrow(0, 0, n)
                    .view(params[i].sizes());
      }
      // A checkpoint of the other kind of moments (the job's optim.type changed): converted.
      optimizer.SetMoment(i, which, value.to(params[i].device()));
    }
  }
  optimizer.set_step(step);
}

}  // namespace lorastream::worker
