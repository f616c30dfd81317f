#include "worker/flux/flux_checkpoint.h"

#include <filesystem>
#include <sstream>

#include "common/formats/checkpoint_dir.h"
#include "worker/flux/flux_adapter_io.h"

namespace lorastream::worker::flux {

namespace fs = std::filesystem;

std::vector<std::string> FluxParamNames(const FluxAdapter& adapter) {
  std::vector<std::string> out;
  for (const auto& [module, m] : adapter.modules()) {
    out.push_back(KohyaModuleName(module) + ".lora_down.weight");
    out.push_back(KohyaModuleName(module) + ".lora_up.weight");
  }
  return out;
}

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

}  // namespace lorastream::worker::flux
