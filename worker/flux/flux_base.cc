#include "worker/flux/flux_base.h"

#include <map>
#include <optional>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/flux_diffusers.h"
#include "common/format_bytes.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "worker/model/base_weights.h"

namespace lorastream::worker::flux {

namespace {

at::Tensor FileTensor(const SafetensorsFile& file, const SafetensorsEntry& e) {
  // from_blob over the read-only mapping: only read (converted into our own buffers).
  return at::from_blob(const_cast<uint8_t*>(file.Data(e)), e.shape,
                       at::TensorOptions().dtype(ScalarTypeOf(e.dtype, e.name)));
}

// `n` zeroed host bytes starting on a page boundary, as a store's segments do: the CUDA
// backend registers a streamed unit's pages for direct copies.
at::Tensor PageAlignedBytes(uint64_t n) {
  constexpr int64_t kPage = 4096;
  const at::Tensor block = at::zeros({static_cast<int64_t>(n) + kPage}, at::kByte);
  const auto address = reinterpret_cast<uintptr_t>(block.data_ptr<uint8_t>());
  const int64_t skip = static_cast<int64_t>((kPage - address % kPage) % kPage);
  return block.narrow(0, skip, static_cast<int64_t>(n));
}

// A checkpoint's tensors in BFL's naming, whichever layout it is stored in; the views and
// concatenations it returns are only read.
class BflSource {
 public:
  explicit BflSource(const std::string& path) {
    if (DetectFluxCheckpoint(path) == FluxCheckpointKind::kBflFile) {
      file_.emplace(SafetensorsFile::Open(path));
      config_ = FluxConfigFromHeader(file_->header(), path);
      return;
    }
    diffusers_.emplace(FluxDiffusersFolder::Open(path));
    config_ = diffusers_->config();
    for (auto& part : FluxDiffusersParts(config_)) parts_[part.bfl].push_back(std::move(part));
  }

  const FluxConfig& config() const { return config_; }
  bool is_diffusers() const { return diffusers_.has_value(); }

  // The BFL tensor `name`: a view of the file's, or diffusers' parts by row (a new tensor).
  at::Tensor Get(const std::string& name) const {
    if (file_) {
      const SafetensorsEntry* e = file_->Find(name);
      LS_CHECK(e != nullptr, "validated FLUX file lacks " + name);
      return FileTensor(*file_, *e);
    }
    std::vector<at::Tensor> rows;
    for (const FluxDiffusersPart& p : parts_.at(name)) {
      const auto ref = diffusers_->Get(p.diffusers);
      rows.push_back(FileTensor(*ref.file, *ref.entry).narrow(0, p.diffusers_row, p.rows));
    }
    return rows.size() == 1 ? rows[0] : at::cat(rows, 0);
  }

 private:
  FluxConfig config_;
  std::optional<SafetensorsFile> file_;
  std::optional<FluxDiffusersFolder> diffusers_;
  std::map<std::string, std::vector<FluxDiffusersPart>> parts_;  // by BFL name, in row order
};

}  // namespace

FluxBase FluxBase::Load(const std::string& path, int64_t singles_per_unit, c10::ScalarType dtype,
                        c10::Device device) {
  const BflSource source(path);
  FluxBase b;
  b.config_ = source.config();
  b.singles_per_unit_ = singles_per_unit;
  b.manifest_.store_name = "flux";
  b.manifest_.config.model_type = kFluxModelType;
  b.manifest_.dtype = DTypeOf(dtype);
  b.manifest_.source_dir = path;
  const auto units = FluxUnits(b.config_, singles_per_unit);
  for (size_t u = 0; u < units.size(); ++u) {
    SegmentInfo seg =
        LayoutSegment(FluxUnitShapes(b.config_, units[u]), "flux-unit-" + std::to_string(u),
                      b.manifest_.dtype, b.manifest_.alignment);
    at::Tensor bytes = PageAlignedBytes(seg.nbytes);
    for (const auto& t : seg.tensors)
      bytes.narrow(0, static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes))
          .view(dtype)
          .view(t.shape)
          .copy_(source.Get(t.name));
    b.manifest_.blocks.push_back(seg);  // served by name (BlockNaming::kByName)
    b.layouts_.push_back(std::move(seg));
    b.unit_buffers_.push_back(bytes);
  }
  for (const auto& [name, shape] : FluxRestShapes(b.config_))
    b.rest_[name] = source.Get(name).to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  uint64_t double_bytes = 0, unit_max = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].is_double) double_bytes = b.layouts_[u].nbytes;
    unit_max = std::max(unit_max, b.layouts_[u].nbytes);
  }
  LS_LOG_INFO(
      "FLUX {} ({}): {} double + {} single blocks (hidden {}, {} heads), {} units of up to {} "
      "(a double block {}), guidance {}",
      path, source.is_diffusers() ? "diffusers folder" : "BFL file", b.config_.depth,
      b.config_.depth_single, b.config_.hidden_size, b.config_.num_heads, units.size(),
      FormatBytes(unit_max), FormatBytes(double_bytes),
      b.config_.guidance_embed ? "embedded" : "none");
  return b;
}

std::vector<const uint8_t*> FluxBase::unit_bytes() const {
  std::vector<const uint8_t*> out;
  for (const auto& t : unit_buffers_) out.push_back(t.data_ptr<uint8_t>());
  return out;
}

ResidencyPlan FluxBase::SwapPlan(int64_t blocks_to_swap, int64_t ring_size) const {
  const int units = static_cast<int>(manifest_.blocks.size());
  if (blocks_to_swap > units)
    throw Error(ErrorCode::kRefused, "flux.blocks_to_swap must be at most " +
                                         std::to_string(units) + " (the model's streaming units)");
  return PlanFromSwapCount(units, static_cast<int>(blocks_to_swap), static_cast<int>(ring_size));
}

std::unique_ptr<StreamEngine> FluxBase::MakeEngine(int64_t blocks_to_swap, int64_t ring_size,
                                                   c10::Device device,
                                                   const StreamEngineOptions& options) const {
  return MakeEngine(SwapPlan(blocks_to_swap, ring_size), device, options);
}

std::unique_ptr<StreamEngine> FluxBase::MakeEngine(const ResidencyPlan& plan, c10::Device device,
                                                   const StreamEngineOptions& options) const {
  return MakeStreamEngine(manifest_, unit_bytes(), plan, device, options);
}

}  // namespace lorastream::worker::flux
