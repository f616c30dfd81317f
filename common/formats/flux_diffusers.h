// FLUX.1 as diffusers stores it: a folder with transformer/config.json (_class_name
// FluxTransformer2DModel) and transformer/diffusion_pytorch_model.safetensors, or its shards
// listed in diffusion_pytorch_model.safetensors.index.json. Its tensors are BFL's under
// FluxTransformer2DModel's names (diffusers' convert_flux_transformer_checkpoint_to_diffusers,
// loaders/single_file_utils.py): the fused projections split (a double block's qkv into
// attn.to_q/to_k/to_v and add_q_proj/add_k_proj/add_v_proj, a single block's linear1 into
// attn.to_q/to_k/to_v and proj_mlp), the final AdaLN's halves swapped ([scale; shift] where BFL
// has [shift; scale]), the rest renamed. It is read as it is: converted by name to BFL's layout
// as each tensor is loaded. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/flux_config.h"
#include "common/formats/safetensors.h"

namespace lorastream {

// A run of rows shared by a BFL tensor and a diffusers one: BFL rows [bfl_row, bfl_row + rows)
// of `bfl` are diffusers rows [diffusers_row, diffusers_row + rows) of `diffusers`, all of
// the other dimensions alike.
struct FluxDiffusersPart {
  std::string bfl, diffusers;
  int64_t bfl_row = 0, diffusers_row = 0, rows = 0;
};

// Every part of every tensor of a FLUX.1 of shape `c`, in FluxAllShapes order (a tensor of
// several parts: its parts in row order).
std::vector<FluxDiffusersPart> FluxDiffusersParts(const FluxConfig& c);

// The diffusers tensors of shape `c` with their shapes, in the order of FluxDiffusersParts'
// first appearance.
TensorShapes FluxDiffusersShapes(const FluxConfig& c);

// transformer/config.json's text for shape `c`. Refuses (kUnsupported) a shape diffusers'
// FluxTransformer2DModel cannot hold: a RoPE theta other than 10000 or an MLP other than
// 4 x hidden.
std::string FluxDiffusersConfigJson(const FluxConfig& c);

// A diffusers FLUX folder opened: its shape from transformer/config.json (num_layers,
// num_single_layers, num_attention_heads x attention_head_dim, joint_attention_dim,
// pooled_projection_dim, in_channels, guidance_embeds, axes_dims_rope), and its tensors, each
// checked against that shape: a missing, extra or misshapen tensor is Error(kCorrupt) naming
// it and the folder.
class FluxDiffusersFolder {
 public:
  // `path`: the model folder (with transformer/) or the transformer folder itself.
  static FluxDiffusersFolder Open(const std::string& path);
  const FluxConfig& config() const { return config_; }
  const std::string& dir() const { return tensors_.dir(); }
  // The file and entry of a diffusers tensor (validated).
  SafetensorsFolder::Ref Get(const std::string& name) const { return tensors_.Get(name); }

 private:
  FluxConfig config_;
  SafetensorsFolder tensors_;
};

}  // namespace lorastream
