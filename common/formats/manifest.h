// What a store publishes: the model's architecture and, per shared-memory segment, where
// each tensor lies. Torch-free; the store writes it, workers and `verify` read it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/dtype.h"
#include "common/formats/flux_config.h"
#include "common/formats/model_config.h"
#include "common/formats/model_family.h"
#include "common/formats/quant_format.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/tokenizer_id.h"

namespace lorastream {

// The model_type of a manifest whose blocks are FLUX.1 streaming units
// (common/formats/flux_layout.h).
inline constexpr const char* kFluxModelType = "flux";

// One tensor inside a segment: bytes [offset, offset + nbytes) of the segment.
struct TensorSlice {
  std::string name;  // relative to "model.layers.{i}." in a block segment, full in the rest
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // a multiple of Manifest::alignment
  uint64_t nbytes = 0;
  // A compressed projection weight (common/formats/quant_format.h): `dtype` is then the stored
  // element type, `shape` the weight's own, and its scales are the slices QuantAuxTensors names.
  QuantInfo quant;
};

// One shared-memory segment: a transformer block, or the rest (embeddings, norm, lm_head).
struct SegmentInfo {
  std::string shm_name;              // the POSIX shm object's name
  uint64_t nbytes = 0;               // the packed size (the mapping may be rounded up to a page)
  uint64_t checksum = 0;             // over [0, nbytes)
  std::vector<TensorSlice> tensors;  // in the canonical order of ModelConfig::*TensorShapes()

  // nullptr when the segment holds no tensor of that name.
  const TensorSlice* Find(const std::string& name) const;
};

struct Manifest {
  std::string store_name;
  uint64_t generation = 0;  // unique per `serve` start
  std::string fingerprint;  // identifies the weights (same checkpoint => same fingerprint)
  ModelConfig config;
  DType dtype = DType::kBF16;  // of every floating-point tensor in the store
  uint64_t alignment = 256;
  std::vector<SegmentInfo> blocks;  // blocks[i] holds model.layers.{i}.*
  SegmentInfo rest;
  int64_t owner_pid = 0;          // the serving store process
  uint64_t owner_start_time = 0;  // its start time (/proc/PID/stat field 22): pid reuse guard
  std::string source_dir;         // the checkpoint folder it was loaded from
  TokenizerId tokenizer;          // its tokenizer.json's; empty fingerprint = the folder had none
  // A FLUX.1 store (config.model_type kFluxModelType, config's other fields unused): its
  // shape, and the single-stream blocks packed per unit; blocks[u] is unit u of
  // FluxUnits(flux, flux_singles_per_unit).
  FluxConfig flux;
  int64_t flux_singles_per_unit = 0;
  // A Qwen-Image store (config.model_type kQwenImageModelType, config's other fields unused):
  // its shape; blocks[u] is transformer block u (common/formats/qwen_image_layout.h).
  QwenImageConfig qwen_image;

  bool is_flux() const { return config.model_type == kFluxModelType; }
  bool is_qwen_image() const { return config.model_type == kQwenImageModelType; }
  // A diffusion transformer's store (FLUX.1 or Qwen-Image): its units name their tensors in
  // full ("double_blocks.0.img_attn.qkv.weight"), and it has no LM head.
  bool is_diffusion() const { return is_flux() || is_qwen_image(); }
  // The model family its units belong to, and as logs, listings and refusals name it:
  // "FLUX.1", "Qwen-Image", or "LLM (MODEL_TYPE)".
  ModelFamily model_family() const {
    return is_flux()         ? ModelFamily::kFlux
           : is_qwen_image() ? ModelFamily::kQwenImage
                             : ModelFamily::kLlm;
  }
  std::string family() const;
  // What block i's tensor names are relative to: "model.layers.I." for an LLM, "" for a
  // diffusion store (its names are full).
  std::string block_prefix(size_t i) const;

  uint64_t total_bytes() const;  // sum of every segment's nbytes
  QuantInfo quant() const;       // the blocks' compression (none when uncompressed)
  // The rest segment's slice of the LM head's weights (a tied model's embedding table);
  // nullptr for a FLUX store.
  const TensorSlice* head() const;
  // What is stored compressed, for logs and listings: ", blocks nf4 (...)" and, when they are,
  // ", LM head nf4" / ", embedding nf4" ("LM head and embedding" for a tied table); "" when
  // nothing is.
  std::string DescribeCompression() const;
};

// The one packed layout of a segment, used by the store and by every other packer (the
// worker packing a checkpoint for streaming, tests): `shapes` in their canonical order
// (ModelConfig::BlockTensorShapes()/RestTensorShapes()), each tensor at the next multiple of
// `alignment` (a power of two), all of `dtype`; nbytes ends at the last tensor's last byte.
// With a compressed `projections` format, each projection weight (IsProjectionWeight) is
// stored in it and followed by its auxiliary tensors (QuantAuxTensors).
SegmentInfo LayoutSegment(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                          const std::string& shm_name, DType dtype, uint64_t alignment,
                          const QuantInfo& projections = {});
// The same with the weights named in `compressed` (and no other) stored in `format`: the rest
// segment of a store whose LM head or embedding table is compressed (IsCompressibleRestWeight).
SegmentInfo LayoutSegment(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                          const std::string& shm_name, DType dtype, uint64_t alignment,
                          const QuantInfo& format, const std::vector<std::string>& compressed);

// The family's shape as JSON text, as the manifest records it: an LLM's config, FLUX.1's
// ({shape..., "singles_per_unit": n}) or Qwen-Image's (its diffusers config.json); what a
// store's fingerprint covers besides the bytes.
std::string ManifestShapeJson(const Manifest& manifest);
// Error(kCorrupt) naming `source` and the segment unless every segment of `m` is exactly
// `want`'s layout (`m` a diffusion manifest, `want` its family's layout of m's shape, dtype,
// alignment and compression), so that an attacher hands out each unit's tensors by name.
// `unit` names a segment in the message ("unit", "block").
void RequireManifestLayout(const Manifest& m, const Manifest& want, const std::string& source,
                           const std::string& unit);

// The manifest as JSON text (uint64 values as 16-digit hex strings, so that every JSON reader
// keeps them exact) and back. ManifestFromJson validates everything a reader relies on
// (offsets aligned and inside their segment, sizes matching shapes) and throws
// Error(kCorrupt) naming `source` and the field.
std::string ManifestToJson(const Manifest& manifest);
Manifest ManifestFromJson(const std::string& text, const std::string& source);

}  // namespace lorastream
