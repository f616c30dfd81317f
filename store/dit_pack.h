// Planning a store of a diffusion transformer (FLUX.1, Qwen-Image): its checkpoint, in any of
// the family's forms (common/formats/flux_layout.h's and common/formats/qwen_image_layout.h's
// readers), packed into one segment per streaming unit and one for the tensors outside the blocks,
// in the family's layout (FluxManifest, QwenImageManifest): the very bytes a worker packing the
// checkpoint itself lays out. Nothing is allocated here, so a bad checkpoint is refused before
// anything exists in /dev/shm.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "common/formats/flux_layout.h"
#include "common/formats/qwen_image_layout.h"
#include "store/layout.h"

namespace lorastream::store {

struct DitPackPlan {
  std::shared_ptr<const void> reader;  // the checkpoint reader every source points into
  // What LoadSegments fills: the layout's segments with each tensor split into the runs of
  // rows its checkpoint holds (a FLUX diffusers folder keeps a fused qkv as to_q, to_k and
  // to_v), each piece with its source. The segments' bytes, and so their checksums, are the
  // layout's.
  PackPlan load;
  Manifest layout;                      // the family's layout (whole tensors)
  std::deque<SafetensorsEntry> pieces;  // the sources of load's split slices
};

// A diffusion checkpoint as the planner reads it.
struct DitCheckpoint {
  std::shared_ptr<const void> reader;  // kept open by the plan
  TensorShapes shapes;                 // every tensor, canonical names
  // The runs of rows a canonical tensor is held as, in row order.
  std::function<std::vector<SafetensorsRows>(const std::string&)> pieces;
  // A block linear's weight: what --quantize compresses and an fp8 checkpoint holds in fp8.
  std::function<bool(const std::string&)> is_block_linear;
  // The family's layout of the checkpoint's shape in `dtype`, block linears in `linears`.
  std::function<Manifest(DType dtype, const QuantInfo& linears)> layout;
};

// Validates the checkpoint (floating point, one dtype unless options.to_bf16) and plans it;
// Error(kCorrupt/kUnsupported) naming the path and the tensor. With options.quantize, every
// block linear's weight is stored in the store's format (StoreQuantFormat) with its scales,
// quantised by QuantizeSegments from the whole weight (a diffusers folder's runs of rows
// together). A checkpoint whose block linears' weights are fp8 (F8_E4M3: FLUX's
// flux1-dev-fp8, ComfyUI's qwen_image_fp8_e4m3fn) is stored as it is, in the fp8 format with
// scales of 1 (exact: every e4m3 value is a bf16 one); every other tensor must be plain.
// Every FLUX.1 and Qwen-Image weight fits both formats (fp8 tiles cover any shape; a linear's
// element count is even, as head_dim is).
DitPackPlan PlanDitPack(const std::string& path, const PackOptions& options,
                        DitCheckpoint checkpoint);
// FLUX.1: BFL's single file or a diffusers folder, `singles_per_unit` single blocks per unit
// (FluxUnits, recorded in the manifest).
DitPackPlan PlanFluxPack(const std::string& path, const PackOptions& options,
                         int64_t singles_per_unit = kFluxDefaultSinglesPerUnit);
// Qwen-Image: ComfyUI's single file or a diffusers folder, one block per unit.
DitPackPlan PlanQwenImagePack(const std::string& path, const PackOptions& options);

// The manifest to publish once `plan.load` is loaded: the layout with the loaded segments'
// names, sizes and checksums and the load manifest's store fields.
Manifest DitPublishedManifest(const DitPackPlan& plan);

}  // namespace lorastream::store
