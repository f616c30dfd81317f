// Qwen-Image's transformer (diffusers' QwenImageTransformer2DModel, v0.39) as a checkpoint
// holds it, torch-free: the shape (from the diffusers config.json or inferred from a single
// file's tensors), the canonical tensor list (diffusers' names, which ComfyUI's single files
// keep, bare or under "diffusion_model." / "model.diffusion_model."), what a checkpoint path
// is, the streaming units (one dual-stream block each) and the LoRA targets and names its
// users load (musubi-tuner's and ComfyUI's, diffusers/peft's).
//
// The tensors (D = num_heads x head_dim):
//   img_in [D, in_channels]  txt_norm.weight [joint_dim]  txt_in [D, joint_dim]
//   time_text_embed.timestep_embedder.linear_1 [D, 256], linear_2 [D, D]
//   transformer_blocks.N.: img_mod.1 / txt_mod.1 [6D, D]; attn.to_q/to_k/to_v/to_out.0 and
//     attn.add_q_proj/add_k_proj/add_v_proj/to_add_out [D, D]; attn.norm_q/norm_k/
//     norm_added_q/norm_added_k.weight [head_dim]; img_mlp/txt_mlp .net.0.proj [4D, D] and
//     .net.2 [D, 4D] (every linear with its bias)
//   norm_out.linear [2D, D] (scale, then shift)  proj_out [patch^2 x out_channels, D]
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/formats/block_names.h"
#include "common/formats/safetensors.h"

namespace lorastream {

inline constexpr int64_t kMaxQwenImageBlocks = 1024;  // Qwen-Image: 60

// The model_type of a manifest whose blocks are Qwen-Image's, one per streaming unit
// (common/formats/qwen_image_layout.h).
inline constexpr const char* kQwenImageModelType = "qwen_image";

struct QwenImageConfig {
  int64_t num_layers = 60;
  int64_t num_heads = 24;
  int64_t head_dim = 128;
  int64_t in_channels = 64;   // 16 latent channels x a 2x2 patch
  int64_t out_channels = 16;  // proj_out: patch_size^2 x out_channels
  int64_t patch_size = 2;
  int64_t joint_attention_dim = 3584;  // Qwen2.5-VL-7B's hidden size
  std::array<int64_t, 3> axes_dim{16, 56, 56};
  double theta = 10000.0;  // diffusers fixes it

  int64_t hidden() const { return num_heads * head_dim; }
  int64_t mlp_hidden() const { return 4 * hidden(); }
  int64_t out_dim() const { return patch_size * patch_size * out_channels; }
  // Refuses (kCorrupt, naming `source`) a shape the model cannot compute.
  void Validate(const std::string& source) const;
};

// Block-relative tensors of one block ("img_mod.1.weight", ...), the tensors outside the
// blocks, every tensor with its full name, and block `index`'s (a streaming unit's) with full
// names ("transformer_blocks.3.attn.to_q.weight").
TensorShapes QwenImageBlockShapes(const QwenImageConfig& c);
TensorShapes QwenImageRestShapes(const QwenImageConfig& c);
TensorShapes QwenImageAllShapes(const QwenImageConfig& c);
TensorShapes QwenImageUnitShapes(const QwenImageConfig& c, int64_t index);

// The prefix a single file's names carry: "", "diffusion_model." or "model.diffusion_model."
// (whichever holds img_in.weight); Error(kCorrupt) naming `source` when none does.
std::string QwenImageKeyPrefix(const SafetensorsHeader& header, const std::string& source);
// The shape from a single file's tensors (names after `prefix`): widths from img_in, txt_in,
// proj_out, head_dim from the q norm, blocks from their indices; axes_dim from the metadata
// ("qwen_image.axes_dim") when present, else Qwen-Image's (head_dim 128 only). Then every
// tensor is checked (RequireExactTensors): missing, extra or misshapen refused by name.
QwenImageConfig QwenImageConfigFromHeader(const SafetensorsHeader& header,
                                          const std::string& prefix, const std::string& source);
std::map<std::string, std::string> QwenImageMetadata(const QwenImageConfig& c);

// diffusers' transformer/config.json for `c`, and back (errors name `source` and the key;
// a class other than QwenImageTransformer2DModel, or a variant this model does not compute
// (zero_cond_t, use_additional_t_cond, use_layer3d_rope, guidance_embeds), is refused).
std::string QwenImageConfigJson(const QwenImageConfig& c);
QwenImageConfig QwenImageConfigFromJson(const std::string& text, const std::string& source);

enum class QwenImageCheckpointKind { kSingleFile, kDiffusersFolder };
// A .safetensors file (ComfyUI's qwen_image_bf16.safetensors) or a diffusers folder (the
// model folder with transformer/, or transformer/ itself, its config.json of _class_name
// QwenImageTransformer2DModel). Anything else refused (kUnsupported) saying what was found.
QwenImageCheckpointKind DetectQwenImageCheckpoint(const std::string& path);
// Whether `path` is meant as a Qwen-Image checkpoint: a folder with such a config.json, or a
// .safetensors file whose names are Qwen-Image's (img_in.weight and txt_norm.weight).
bool IsQwenImageCheckpointPath(const std::string& path);

// The linear layers of a block (block-relative module names, "attn.to_q").
std::vector<std::string> QwenImageBlockLinears();
// A target list: "default" (musubi-tuner's networks.lora_qwen_image: every linear of a block
// but the modulations img_mod.1 / txt_mod.1), "attention" (the eight attention projections),
// "all" (every linear, the modulations too) or block-relative names; unknown names refused
// (kRefused) naming `where`.
std::vector<std::string> QwenImageTargets(const std::vector<std::string>& spec,
                                          const std::string& where);
// True for a block linear's weight under its full name: what a compressed store quantises.
bool IsQwenImageBlockLinearWeight(const std::string& name);

}  // namespace lorastream
