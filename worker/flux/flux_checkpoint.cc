#include "worker/flux/flux_checkpoint.h"

#include <filesystem>
#include <sstream>

#include <ATen/ATen.h>

#include "common/checkpoint_dir.h"
#include "common/error.h"
#include "common/safetensors.h"
#include "worker/flux/flux_adapter_io.h"

namespace lorastream::worker::flux {

namespace fs = std::filesystem;

namespace {

// The optimizer's parameter names, in adapter.Params() order (A, B per module, by name).
std::vector<std::string> ParamKeys(const FluxAdapter& adapter) {
  std::vector<std::string> out;
  for (const auto& [module, m] : adapter.modules()) {
    out.push_back(KohyaModuleName(module) + ".lora_down.weight");
    out.push_back(KohyaModuleName(module) + ".lora_up.weight");
  }
  return out;
}

}  // namespace

const std::vector<std::string>& FluxCheckpointFiles() {
  static const std::vector<std::string> names = {kKohyaAdapterFile, kDiffusersAdapterFile,
                                                 kTrainerStateFile};
  return names;
}

std::string FluxJobFingerprint(const FluxJob& j) {
  std::ostringstream s;
  s << "flux rank=" << j.rank << " alpha=" << j.alpha << " targets=";
  for (const auto& t : j.targets) s << t << ",";
  s << " seed=" << j.seed << " batch=" << j.batch_size << " sampling=" << j.timestep_sampling << "/"
    << j.sigmoid_scale << "/" << j.discrete_flow_shift << " guidance=" << j.guidance
    << " cache=" << j.cache_dir;
  return s.str();
}

void SaveFluxAdapters(const FluxAdapter& adapter, const FluxConfig& config,
                      const std::string& dir) {
  SaveKohyaAdapter(adapter, (fs::path(dir) / kKohyaAdapterFile).string());
  SaveDiffusersAdapter(adapter, config, (fs::path(dir) / kDiffusersAdapterFile).string());
}

std::string SaveFluxCheckpoint(const std::string& output_dir, const FluxAdapter& adapter,
                               const FluxConfig& config, AdamW& optimizer,
                               const TrainerStateMeta& meta, int64_t keep) {
  auto write_files = [&](const std::string& tmp_dir) {
    SaveFluxAdapters(adapter, config, tmp_dir);
    const auto keys = ParamKeys(adapter);
    LS_CHECK(keys.size() == optimizer.exp_avg().size(), "optimizer and adapter differ");
    std::vector<at::Tensor> host;
    std::vector<TensorToWrite> tensors;
    for (int which = 0; which < 2; ++which) {
      const auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
      for (size_t i = 0; i < keys.size(); ++i) {
        host.push_back(moments[i].detach().to(at::kCPU, at::kFloat).contiguous());
        tensors.push_back({(which == 0 ? "exp_avg." : "exp_avg_sq.") + keys[i], DType::kF32,
                           host.back().sizes().vec(), host.back().data_ptr()});
      }
    }
    WriteSafetensors((fs::path(tmp_dir) / kTrainerStateFile).string(), tensors,
                     TrainerStateMetadata(meta));
  };
  return PublishCheckpoint(output_dir, meta.step, write_files, keep, /*keep_best=*/false,
                           FluxCheckpointFiles());
}

std::string FindFluxCheckpoint(const std::string& output_dir) {
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return "";
  RemoveStaleCheckpointTemporaries(output_dir);
  return FindResumableCheckpoint(output_dir, FluxCheckpointFiles());
}

TrainerStateMeta LoadFluxCheckpoint(const std::string& dir, const std::string& fingerprint,
                                    FluxAdapter& adapter, AdamW& optimizer) {
  const std::string path = (fs::path(dir) / kTrainerStateFile).string();
  const SafetensorsFile file = SafetensorsFile::Open(path);
  const TrainerStateMeta meta = ParseTrainerStateMetadata(file.header().metadata, path);
  if (meta.fingerprint != fingerprint)
    throw Error(ErrorCode::kRefused,
                path + ": written by a job of other settings (" + meta.fingerprint +
                    "); this job: " + fingerprint +
                    ". Restore those settings to resume, or name another flux.output_dir");
  LoadKohyaAdapter((fs::path(dir) / kKohyaAdapterFile).string(), adapter);
  const auto keys = ParamKeys(adapter);
  for (int which = 0; which < 2; ++which) {
    auto& moments = which == 0 ? optimizer.exp_avg() : optimizer.exp_avg_sq();
    for (size_t i = 0; i < keys.size(); ++i) {
      const std::string key = (which == 0 ? "exp_avg." : "exp_avg_sq.") + keys[i];
      const SafetensorsEntry* e = file.Find(key);
      if (e == nullptr || e->dtype != DType::kF32 || e->shape != moments[i].sizes().vec())
        throw Error(ErrorCode::kCorrupt,
                    path + ": tensor `" + key + "` is missing or has the wrong dtype/shape");
      moments[i].copy_(at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape,
                                     at::TensorOptions().dtype(at::kFloat)));
    }
  }
  optimizer.set_step(meta.step);
  return meta;
}

}  // namespace lorastream::worker::flux
