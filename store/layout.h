// Planning a store: validate a checkpoint's tensors against its config.json and lay out
// one segment per transformer block plus one for the rest, every tensor at an aligned offset
// in the canonical order of ModelConfig::BlockTensorShapes()/RestTensorShapes(). Nothing is
// allocated here, so a bad checkpoint is refused before anything exists in /dev/shm.
#pragma once

#include <cstdint>
#include <vector>

#include "common/formats/manifest.h"
#include "common/formats/safetensors.h"

namespace lorastream::store {

class Progress;

struct PackPlan {
  // Layout only: shm names, checksums, fingerprint and generation are still empty.
  Manifest manifest;
  // Sources parallel to manifest.blocks[i].tensors and manifest.rest.tensors; {nullptr,
  // nullptr} for the slices the loader computes (a quantised weight and its scales).
  std::vector<std::vector<Checkpoint::Ref>> block_sources;
  std::vector<Checkpoint::Ref> rest_sources;
  // The weights to quantise: slice `slice` of block `block` (with its auxiliary slices after
  // it) from `sources`, runs of whole rows in row order that together are the weight (one
  // tensor of an LLM checkpoint; a FLUX.1 diffusers folder keeps a fused qkv as three);
  // `block` == manifest.blocks.size() names the rest segment (a compressed LM head or
  // embedding table).
  struct Quantize {
    size_t block = 0;
    size_t slice = 0;
    std::vector<Checkpoint::Ref> sources;
  };
  std::vector<Quantize> quantize;
  // Slices whose bytes are given here (nf4's nested_offset from a checkpoint's quant_state).
  struct Literal {
    size_t block = 0;
    size_t slice = 0;
    std::vector<uint8_t> bytes;
  };
  std::vector<Literal> literals;
};

struct PackOptions {
  bool to_bf16 = false;      // convert F32/F16 tensors to BF16 (else keep the file's dtype)
  uint64_t alignment = 256;  // of every tensor's offset inside its segment (power of two)
  // Scan every weight for NaN/infinity: reads the whole checkpoint (minutes for a large model
  // on disk). Serve turns it off and calls RefuseNonFiniteWeights once the cheap checks have
  // passed (the store fits /dev/shm), so that a refusal that needs no weight comes at once.
  bool scan_weights = true;
  // Store each block's projection weights compressed (common/formats/quant_format.h); kNone: as
  // they are.
  QuantMethod quantize = QuantMethod::kNone;
  // With `quantize`: the LM head's weights and the embedding table stored compressed too, in
  // the same format (a tied model's one table, which is both, by either flag).
  bool quantize_head = false;
  bool quantize_embedding = false;
};

// The segment of `plan`'s manifest a PackPlan::Quantize or Literal names: block `index`, or
// the rest for index == blocks.size().
SegmentInfo& PlanSegment(Manifest& manifest, size_t index);
const SegmentInfo& PlanSegment(const Manifest& manifest, size_t index);

// Throws Error(kCorrupt) naming the folder and the tensor for a missing block, a missing,
// extra or misshapen tensor, a dtype the store cannot hold, or a NaN/infinite value. The one
// validation of a checkpoint folder: serve, inspect and the worker's direct load all use it.
PackPlan PlanPack(const Checkpoint& checkpoint, const PackOptions& options);

// The NaN/infinity part of PlanPack on its own (for a plan made with scan_weights = false):
// Error(kCorrupt) naming the folder, the tensor and an element, reading on `threads` threads.
// `progress` (optional) gets a phase "checking weights" over the checkpoint's bytes (from
// disk: the load's longest). Returns the bytes read: every source tensor's.
uint64_t RefuseNonFiniteWeights(const PackPlan& plan, Progress* progress = nullptr,
                                int threads = 1);

}  // namespace lorastream::store
