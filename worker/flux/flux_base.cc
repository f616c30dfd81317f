#include "worker/flux/flux_base.h"

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/format_bytes.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "worker/model/base_weights.h"

namespace lorastream::worker::flux {

namespace {

at::Tensor FileTensor(const SafetensorsFile& file, const std::string& name) {
  const SafetensorsEntry* e = file.Find(name);
  LS_CHECK(e != nullptr, "validated FLUX file lacks " + name);
  // from_blob over the read-only mapping: only read (converted into our own buffers).
  return at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape,
                       at::TensorOptions().dtype(ScalarTypeOf(e->dtype, name)));
}

}  // namespace

FluxBase FluxBase::Load(const std::string& path, int64_t singles_per_unit, c10::ScalarType dtype,
                        c10::Device device) {
  if (DetectFluxCheckpoint(path) != FluxCheckpointKind::kBflFile)
    throw Error(ErrorCode::kUnsupported,
                path +
                    ": a diffusers folder; this version reads FLUX.1 from BFL's single file "
                    "(flux1-dev.safetensors, as sd-scripts and ComfyUI use it)");
  const SafetensorsFile file = SafetensorsFile::Open(path);
  FluxBase b;
  b.config_ = FluxConfigFromHeader(file.header(), path);
  b.singles_per_unit_ = singles_per_unit;
  b.manifest_.store_name = "flux";
  b.manifest_.dtype = DTypeOf(dtype);
  b.manifest_.source_dir = path;
  const auto units = FluxUnits(b.config_, singles_per_unit);
  for (size_t u = 0; u < units.size(); ++u) {
    SegmentInfo seg =
        LayoutSegment(FluxUnitShapes(b.config_, units[u]), "flux-unit-" + std::to_string(u),
                      b.manifest_.dtype, b.manifest_.alignment);
    at::Tensor bytes = at::zeros({static_cast<int64_t>(seg.nbytes)}, at::kByte);
    for (const auto& t : seg.tensors)
      bytes.narrow(0, static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes))
          .view(dtype)
          .view(t.shape)
          .copy_(FileTensor(file, t.name));
    // The engine's view: the whole unit as one tensor of the compute dtype (offsets are
    // multiples of the alignment, so every tensor starts on an element boundary).
    const uint64_t elem = DTypeSize(b.manifest_.dtype);
    LS_CHECK(seg.nbytes % elem == 0, "a unit's bytes are whole elements");
    SegmentInfo opaque;
    opaque.shm_name = seg.shm_name;
    opaque.nbytes = seg.nbytes;
    opaque.tensors.push_back({"input_layernorm.weight",
                              b.manifest_.dtype,
                              {static_cast<int64_t>(seg.nbytes / elem)},
                              0,
                              seg.nbytes});
    b.manifest_.blocks.push_back(std::move(opaque));
    b.layouts_.push_back(std::move(seg));
    b.unit_buffers_.push_back(bytes);
  }
  for (const auto& [name, shape] : FluxRestShapes(b.config_))
    b.rest_[name] = FileTensor(file, name).to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  uint64_t double_bytes = 0, unit_max = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].is_double) double_bytes = b.layouts_[u].nbytes;
    unit_max = std::max(unit_max, b.layouts_[u].nbytes);
  }
  LS_LOG_INFO(
      "FLUX {}: {} double + {} single blocks (hidden {}, {} heads), {} units of up to {} "
      "(a double block {}), guidance {}",
      path, b.config_.depth, b.config_.depth_single, b.config_.hidden_size, b.config_.num_heads,
      units.size(), FormatBytes(unit_max), FormatBytes(double_bytes),
      b.config_.guidance_embed ? "embedded" : "none");
  return b;
}

std::vector<const uint8_t*> FluxBase::unit_bytes() const {
  std::vector<const uint8_t*> out;
  for (const auto& t : unit_buffers_) out.push_back(t.data_ptr<uint8_t>());
  return out;
}

std::unique_ptr<StreamEngine> FluxBase::MakeEngine(int64_t blocks_to_swap, int64_t ring_size,
                                                   c10::Device device,
                                                   const StreamEngineOptions& options) const {
  const int units = static_cast<int>(manifest_.blocks.size());
  if (blocks_to_swap > units)
    throw Error(ErrorCode::kRefused, "flux.blocks_to_swap must be at most " +
                                         std::to_string(units) + " (the model's streaming units)");
  const ResidencyPlan plan =
      PlanFromSwapCount(units, static_cast<int>(blocks_to_swap), static_cast<int>(ring_size));
  return MakeStreamEngine(manifest_, unit_bytes(), plan, device, options);
}

}  // namespace lorastream::worker::flux
