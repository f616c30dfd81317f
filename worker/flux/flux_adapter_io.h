// A FLUX adapter in the two formats its users load:
//   kohya (sd-scripts; ComfyUI, Forge, sd-scripts itself): per BFL module
//     lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight  A [r, in]
//     lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight    B [out, r]
//     lora_unet_double_blocks_0_img_attn_qkv.alpha             alpha (a scalar)
//   diffusers/peft (FluxPipeline.load_lora_weights): per diffusers module
//     transformer.transformer_blocks.0.attn.to_q.lora_A.weight / .lora_B.weight
//     fused BFL projections split by rows (qkv -> to_q, to_k, to_v; linear1 -> to_q, to_k,
//     to_v, proj_mlp), each part with the whole A. diffusers reads such a file with
//     lora_alpha = r, so B is saved multiplied by alpha / r: the same update.
// Both in f32.
#pragma once

#include <string>

#include "common/flux_config.h"
#include "worker/flux/flux_model.h"

namespace lorastream::worker::flux {

void SaveKohyaAdapter(const FluxAdapter& adapter, const std::string& path);
void SaveDiffusersAdapter(const FluxAdapter& adapter, const FluxConfig& config,
                          const std::string& path);
// A kohya file's weights into `adapter` (same modules and rank; alpha must match): resume and
// tests. Errors name the file and the tensor.
void LoadKohyaAdapter(const std::string& path, FluxAdapter& adapter);

}  // namespace lorastream::worker::flux
