// FLUX.1's transformer (black-forest-labs/flux, src/flux/model.py) as a checkpoint holds it:
// the shape, read from the tensors of BFL's single file (flux1-dev.safetensors); the canonical
// tensor list (what `lorastream-synth` writes and the worker expects); which checkpoint layout
// a path is; and the adapter names the FLUX trainers' users load (sd-scripts/kohya for
// ComfyUI and Forge, diffusers/peft for load_lora_weights). Torch-free.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/safetensors.h"

namespace lorastream {

// The most blocks of one kind (double or single) a checkpoint may declare through its tensor
// names (FLUX.1: 19 and 38).
inline constexpr int64_t kMaxFluxBlocks = 1024;

struct FluxConfig {
  int64_t hidden_size = 3072;
  int64_t num_heads = 24;                       // head_dim = hidden_size / num_heads
  int64_t depth = 19;                           // double-stream blocks
  int64_t depth_single = 38;                    // single-stream blocks
  int64_t mlp_hidden = 12288;                   // mlp_ratio 4
  int64_t in_channels = 64;                     // 16 latent channels x a 2x2 patch
  int64_t vec_in_dim = 768;                     // CLIP-L pooled
  int64_t context_in_dim = 4096;                // T5-XXL
  std::array<int64_t, 3> axes_dim{16, 56, 56};  // RoPE dims per id axis; sum = head_dim
  double theta = 10000.0;
  bool guidance_embed = true;  // dev: yes; schnell: no

  int64_t head_dim() const { return hidden_size / num_heads; }
  // Refuses (kCorrupt, naming `source`) a shape the model cannot compute.
  void Validate(const std::string& source) const;
};

using TensorShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// Block-relative names and shapes of one double-stream block ("img_attn.qkv.weight", ...),
// of one single-stream block ("linear1.weight", ...), and the tensors outside the blocks (full
// names: "img_in.weight", ..., "final_layer.linear.bias"), in BFL's order.
TensorShapes FluxDoubleBlockShapes(const FluxConfig& c);
TensorShapes FluxSingleBlockShapes(const FluxConfig& c);
TensorShapes FluxRestShapes(const FluxConfig& c);
// Every tensor with its full name ("double_blocks.3.img_attn.qkv.weight").
TensorShapes FluxAllShapes(const FluxConfig& c);

// The streaming units, each one segment of the ring: one double-stream block each, then the
// single-stream blocks `singles_per_unit` at a time. FLUX.1-dev's double block is 648 MiB in
// bf16 and a single one 270 MiB: one single per unit would use 42% of a slot sized for the
// double blocks, two use 83% (three, 810 MiB, would make every slot larger).
struct FluxUnit {
  bool is_double = true;
  int64_t first = 0;  // the first block's index among its kind
  int64_t count = 1;  // blocks in the unit (1 for a double block)
};
std::vector<FluxUnit> FluxUnits(const FluxConfig& c, int64_t singles_per_unit);
// A unit's tensors with their full names, in block order.
TensorShapes FluxUnitShapes(const FluxConfig& c, const FluxUnit& unit);

// The shape from a BFL file's tensors: hidden size, depths, channels and guidance from the
// tensors, head_dim from the q norm's scale; axes_dim and theta from the file's metadata
// ("flux.axes_dim" = "16,56,56", "flux.theta") when present, else FLUX.1's for head_dim 128.
// Then every tensor is checked against FluxAllShapes: a missing, extra or misshapen tensor is
// Error(kCorrupt) naming it and `source`.
FluxConfig FluxConfigFromHeader(const SafetensorsHeader& header, const std::string& source);
// The metadata FluxConfigFromHeader reads axes_dim and theta from (synth writes it).
std::map<std::string, std::string> FluxMetadata(const FluxConfig& c);

enum class FluxCheckpointKind { kBflFile, kDiffusersFolder };
// What `path` is: a .safetensors file in BFL's naming, or a diffusers folder
// (transformer/config.json or a config.json of _class_name FluxTransformer2DModel). Anything
// else is refused (kUnsupported) saying what was found and what is read.
FluxCheckpointKind DetectFluxCheckpoint(const std::string& path);
// Whether `path` is meant as a FLUX.1 checkpoint rather than an LLM's folder: any file (BFL's
// single file; DetectFluxCheckpoint names what is wrong with another), or a folder whose
// config.json or transformer/config.json is a FluxTransformer2DModel's.
bool IsFluxCheckpointPath(const std::string& path);

// The LoRA module names FLUX trainers adapt, block-relative ("img_attn.qkv", "linear1").
// sd-scripts' default (every Linear inside the blocks, the modulations included) and the
// attention projections alone.
std::vector<std::string> FluxDoubleLinears();
std::vector<std::string> FluxSingleLinears();
// True for the weight of one of those linears under its full BFL name
// ("double_blocks.3.img_attn.qkv.weight", "single_blocks.0.linear2.weight"): the block
// weights a compressed store quantises (common/formats/quant_format.h).
bool IsFluxBlockLinearWeight(const std::string& name);
// A target list for a job: "all" (sd-scripts' default), "attention" (double blocks' qkv and
// proj of both streams; single blocks' linear1, which holds their q, k and v, and linear2,
// their output projection) or a list of block-relative names; unknown names are refused
// (kRefused, naming `where`).
std::vector<std::string> FluxTargets(const std::vector<std::string>& spec,
                                     const std::string& where);

// sd-scripts' (kohya's) key stem of a module: "double_blocks.0.img_attn.qkv" ->
// "lora_unet_double_blocks_0_img_attn_qkv" (its tensors: .lora_down.weight, .lora_up.weight,
// .alpha).
std::string KohyaModuleName(const std::string& module);

// A BFL module's diffusers names (FluxTransformer2DModel) with the row range of BFL's output
// each one is: fused qkv splits into to_q/to_k/to_v (add_*_proj for the text stream), linear1
// into to_q/to_k/to_v/proj_mlp; the others map one to one. `module` is a full BFL name.
struct DiffusersPart {
  std::string name;  // "transformer_blocks.0.attn.to_q"
  int64_t row_begin = 0, row_end = 0;
};
std::vector<DiffusersPart> DiffusersParts(const std::string& module, const FluxConfig& c);

}  // namespace lorastream
