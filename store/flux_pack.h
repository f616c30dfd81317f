// Planning a FLUX.1 store: BFL's single file or a diffusers folder (common/flux_layout.h's
// reader) packed into one segment per streaming unit (FluxUnits, `singles_per_unit` single
// blocks per unit, recorded in the manifest) and one for the tensors outside the blocks, in
// FluxManifest's layout: the very bytes a worker packing the checkpoint itself lays out.
// Nothing is allocated here, so a bad checkpoint is refused before anything exists in
// /dev/shm.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "common/flux_layout.h"
#include "store/layout.h"

namespace lorastream::store {

struct FluxPackPlan {
  std::unique_ptr<FluxCheckpointReader> reader;  // the files every source points into
  // What LoadSegments fills: FluxManifest's segments with each tensor split into the runs of
  // rows its checkpoint holds (a diffusers folder keeps a fused qkv as to_q, to_k and to_v),
  // each piece with its source. The segments' bytes, and so their checksums, are the layout's.
  PackPlan load;
  std::deque<SafetensorsEntry> pieces;  // the sources of load's split slices
};

// Validates the checkpoint (every tensor of FLUX.1's shape, floating point, one dtype unless
// options.to_bf16) and plans it; Error(kCorrupt/kUnsupported) naming the path and the tensor.
// With options.quantize, every block linear's weight (IsFluxBlockLinearWeight) is stored in
// the store's format (StoreQuantFormat) with its scales, quantised by QuantizeSegments from
// the whole weight (a diffusers folder's runs of rows together); the layout is FluxManifest's
// with that format. Every FLUX.1 weight fits both formats (fp8 tiles cover any shape; a
// linear's element count is even, as head_dim is).
FluxPackPlan PlanFluxPack(const std::string& path, const PackOptions& options,
                          int64_t singles_per_unit = kFluxDefaultSinglesPerUnit);

// The manifest to publish once `plan.load` is loaded: FluxManifest's layout with the loaded
// segments' names, sizes and checksums and the load manifest's store fields.
Manifest FluxPublishedManifest(const FluxPackPlan& plan);

}  // namespace lorastream::store
