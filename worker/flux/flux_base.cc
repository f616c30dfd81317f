#include "worker/flux/flux_base.h"

#include <memory>

#include <ATen/ATen.h>

#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/formats/flux_layout.h"
#include "common/formats/safetensors.h"
#include "worker/model/base_weights.h"
#include "worker/stream/unit_pack.h"

namespace lorastream::worker::flux {

namespace {

// BFL tensor `name` of the checkpoint: a view of the file's, or a concatenation of
// diffusers' runs of rows (only read).
at::Tensor BflTensor(const FluxCheckpointReader& source, const std::string& name) {
  std::vector<at::Tensor> rows;
  for (const FluxCheckpointReader::Piece& p : source.Pieces(name)) {
    const at::Tensor t = MappedTensor(*p.file, *p.entry, p.entry->name);
    rows.push_back(p.entry->shape.empty() ? t : t.narrow(0, p.source_row, p.rows));
  }
  return rows.size() == 1 ? rows[0] : at::cat(rows, 0);
}

}  // namespace

FluxBase FluxBase::Load(const std::string& path, int64_t singles_per_unit, c10::ScalarType dtype,
                        c10::Device device, const std::string& store_key) {
  const FluxCheckpointReader source = FluxCheckpointReader::Open(path);
  for (const auto& [name, shape] : FluxAllShapes(source.config()))
    for (const FluxCheckpointReader::Piece& p : source.Pieces(name))
      if (p.entry->dtype == DType::kF8E4M3)
        RefuseFp8Checkpoint(path, p.entry->name, "FLUX", store_key);
  FluxBase b;
  b.config_ = source.config();
  b.singles_per_unit_ = singles_per_unit;
  // The store's layout (common/formats/flux_layout.h), in host buffers of this process.
  b.manifest_ = FluxManifest(b.config_, singles_per_unit, DTypeOf(dtype), Manifest{}.alignment);
  b.manifest_.store_name = "flux";
  b.manifest_.source_dir = path;
  const SourceTensor tensor = [&](const std::string& name) { return BflTensor(source, name); };
  b.unit_buffers_ = PackUnitBuffers(b.manifest_, tensor, "flux");
  b.layouts_ = b.manifest_.blocks;
  b.rest_ = LoadRestTensors(b.manifest_.rest, tensor, device, dtype);
  b.unit_data_ = BufferPointers(b.unit_buffers_);
  b.LogLoaded(path + (source.is_diffusers() ? " (diffusers folder)" : " (BFL file)"));
  return b;
}

FluxBase FluxBase::FromStore(const std::string& name, c10::ScalarType dtype, c10::Device device,
                             const std::string& store_key, const std::string& dtype_key) {
  AttachedUnits a = AttachUnitStore(
      name, ModelFamily::kFlux,
      store_key + " names a store of a FLUX checkpoint: lorastream-store serve FLUX_PATH",
      dtype_key, dtype, device);
  FluxBase b;
  b.config_ = a.manifest.flux;
  b.singles_per_unit_ = a.manifest.flux_singles_per_unit;
  b.manifest_ = std::move(a.manifest);
  b.layouts_ = b.manifest_.blocks;
  b.unit_data_ = std::move(a.unit_data);
  b.rest_ = std::move(a.rest);
  b.store_ = std::move(a.store);
  b.LogLoaded(a.description);
  return b;
}

FluxBase FluxBase::ForJob(const FluxJob& job, c10::ScalarType dtype, c10::Device device) {
  const std::string store_key = FluxKeyName(job, "store");
  return job.store.empty()
             ? Load(job.checkpoint, job.singles_per_unit, dtype, device, store_key)
             : FromStore(job.store, dtype, device, store_key, FluxKeyName(job, "dtype"));
}

void FluxBase::LogLoaded(const std::string& from) const {
  uint64_t double_bytes = 0, unit_max = 0;
  const auto units = FluxUnits(config_, singles_per_unit_);
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].is_double) double_bytes = layouts_[u].nbytes;
    unit_max = std::max(unit_max, layouts_[u].nbytes);
  }
  LS_LOG_INFO(
      "FLUX {}: {} double + {} single blocks (hidden {}, {} heads), {} units of up to {} "
      "(a double block {}), guidance {}",
      from, config_.depth, config_.depth_single, config_.hidden_size, config_.num_heads,
      units.size(), FormatBytes(unit_max), FormatBytes(double_bytes),
      config_.guidance_embed ? "embedded" : "none");
}

ResidencyPlan FluxBase::SwapPlan(int64_t blocks_to_swap, int64_t ring_size,
                                 const std::string& key) const {
  return UnitSwapPlan(static_cast<int>(manifest_.blocks.size()), blocks_to_swap, ring_size, key);
}

std::unique_ptr<StreamEngine> FluxBase::MakeEngine(int64_t blocks_to_swap, int64_t ring_size,
                                                   c10::Device device,
                                                   const StreamEngineOptions& options) const {
  return MakeEngine(SwapPlan(blocks_to_swap, ring_size), device, options);
}

std::unique_ptr<StreamEngine> FluxBase::MakeEngine(const ResidencyPlan& plan, c10::Device device,
                                                   const StreamEngineOptions& options) const {
  return MakeStreamEngine(manifest_, unit_data_, plan, device, options);
}

}  // namespace lorastream::worker::flux
