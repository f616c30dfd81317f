// A Qwen-Image adapter in the two formats its users load, both f32:
//   ComfyUI (and musubi-tuner's converted "other" form, ai-toolkit's): per module
//     diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight  A [r, in]
//     diffusion_model.transformer_blocks.0.attn.to_q.lora_up.weight    B [out, r]
//     diffusion_model.transformer_blocks.0.attn.to_q.alpha             alpha (a scalar)
//   diffusers/peft (QwenImagePipeline.load_lora_weights): per module
//     transformer.transformer_blocks.0.attn.to_q.lora_A.weight / .lora_B.weight
//     diffusers reads such a file with lora_alpha = r, so B is saved multiplied by alpha / r:
//     the same update.
// The ComfyUI file is also the checkpoint's adapter (read back exactly on resume).
#pragma once

#include <string>

#include "common/formats/qwen_image_config.h"
#include "worker/model/dit_adapter_io.h"
#include "worker/qwen_image/qwen_image_model.h"

namespace lorastream::worker::qwen_image {

inline constexpr const char* kComfyAdapterFile = "adapter_comfyui.safetensors";
inline constexpr const char* kQwenDiffusersAdapterFile = "pytorch_lora_weights.safetensors";

// "transformer_blocks.0.attn.to_q" -> "diffusion_model.transformer_blocks.0.attn.to_q".
std::string ComfyModuleName(const std::string& module);
void SaveComfyAdapter(const QwenImageAdapter& adapter, const std::string& path);
void SaveQwenDiffusersAdapter(const QwenImageAdapter& adapter, const std::string& path);
// Both files into `dir`.
void SaveQwenImageAdapters(const QwenImageAdapter& adapter, const std::string& dir);
// A ComfyUI file's weights into `adapter` (same modules, rank and alpha); errors name the file
// and the tensor.
void LoadComfyAdapter(const std::string& path, QwenImageAdapter& adapter);
// The ComfyUI file `path` names: itself, or DIR/adapter_comfyui.safetensors for a folder (a
// Qwen-Image job's output_dir or checkpoint).
std::string ComfyAdapterFile(const std::string& path);
// What a ComfyUI (or musubi-tuner) file holds: its modules, rank and alpha
// (dit::ReadDownUpAdapterInfo over the blocks of `config`).
dit::DownUpAdapterInfo ReadComfyAdapterInfo(const std::string& path, const QwenImageConfig& config);

}  // namespace lorastream::worker::qwen_image
