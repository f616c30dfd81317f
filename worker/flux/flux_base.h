// FLUX.1's frozen base for training: read from BFL's single file (common/formats/flux_config.h
// validates it) or a diffusers folder (common/formats/flux_diffusers.h: converted by name to BFL's
// layout as it is read), its blocks packed per streaming unit into host buffers in the store's
// layout (common/formats/flux_layout.h: one contiguous region per unit, one H2D copy moves a unit),
// converted to the compute dtype once; or attached from a store serving it, the units then
// being the store's read-only segments. The tensors outside the blocks are on the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/flux_config.h"
#include "common/formats/manifest.h"
#include "common/job/flux_job.h"
#include "worker/flux/flux_model.h"
#include "worker/model/block_provider.h"
#include "worker/stream/stream_engine.h"
#include "worker/stream/unit_pack.h"

namespace lorastream::store {
class AttachedStore;
}

namespace lorastream::worker::flux {

using worker::PageAlignedHostBytes;

class FluxBase {
 public:
  // BFL's single file or a diffusers folder; any other layout is refused by name
  // (DetectFluxCheckpoint), and so is an fp8 checkpoint (a store serves it: FromStore), naming
  // `store_key` (the job's key for a store, as its file writes it: FluxKeyName).
  static FluxBase Load(const std::string& path, int64_t singles_per_unit, c10::ScalarType dtype,
                       c10::Device device, const std::string& store_key = "flux.store");
  // The FLUX.1 store `name` (lorastream-store serve FLUX_PATH), attached read-only: its units
  // stream from the shared mapping (nothing of them is copied in this process), packed as
  // the store fixed them (its singles_per_unit); the tensors outside the blocks are copied
  // to `device`. Refuses (kRefused) an LLM store and a plain store of another dtype than
  // `dtype`. A compressed store (`serve --quantize`): its units are copied compressed and
  // the engine expands their linears into `dtype` on the device at each use (a resident unit
  // stays compressed on the device too: worker/stream/stream_engine.h), so any dtype goes.
  // Refusals name `store_key` and `dtype_key`, the job's keys as its file writes them.
  static FluxBase FromStore(const std::string& name, c10::ScalarType dtype, c10::Device device,
                            const std::string& store_key = "flux.store",
                            const std::string& dtype_key = "flux.dtype");
  // The base a job names: its store, or its checkpoint packed per its singles_per_unit
  // (refusals naming the job's keys as its file writes them).
  static FluxBase ForJob(const FluxJob& job, c10::ScalarType dtype, c10::Device device);

  const FluxConfig& config() const { return config_; }
  int64_t singles_per_unit() const { return singles_per_unit_; }
  // Unit u's packed layout (full BFL tensor names), one contiguous segment per unit.
  const std::vector<SegmentInfo>& layouts() const { return layouts_; }
  // What the streaming engine is given: the same segments in a manifest of model_type
  // "flux", so that each unit is served with its tensors by name (BlockWeights::named), in
  // the compute dtype (a compressed unit's linears expanded into it: worker/model/quant_expand.h).
  const Manifest& engine_manifest() const { return manifest_; }
  const std::vector<const uint8_t*>& unit_bytes() const { return unit_data_; }
  const NamedTensors& rest() const { return rest_; }

  // The streaming engine over the units: `blocks_to_swap` of them streamed through
  // `ring_size` slots, the others resident (0: the fully resident run, streaming nothing);
  // or as `plan` says (the planner's, worker/flux/flux_plan.h).
  std::unique_ptr<StreamEngine> MakeEngine(int64_t blocks_to_swap, int64_t ring_size,
                                           c10::Device device,
                                           const StreamEngineOptions& options = {}) const;
  std::unique_ptr<StreamEngine> MakeEngine(const ResidencyPlan& plan, c10::Device device,
                                           const StreamEngineOptions& options = {}) const;
  // The plan of `blocks_to_swap` units through `ring_size` slots; refuses more units than
  // the model has, naming `key` (the job's key, FluxKeyName).
  ResidencyPlan SwapPlan(int64_t blocks_to_swap, int64_t ring_size,
                         const std::string& key = "flux.blocks_to_swap") const;

 private:
  void LogLoaded(const std::string& from) const;

  FluxConfig config_;
  int64_t singles_per_unit_ = 2;
  std::vector<SegmentInfo> layouts_;
  Manifest manifest_;
  std::vector<at::Tensor> unit_buffers_;  // Load: host uint8, one per unit, page-aligned
  std::shared_ptr<const store::AttachedStore> store_;  // FromStore: the mapping units are in
  std::vector<const uint8_t*> unit_data_;              // unit u's bytes, either way
  NamedTensors rest_;
};

}  // namespace lorastream::worker::flux
