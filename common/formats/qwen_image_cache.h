// The caches musubi-tuner writes for Qwen-Image, read as they are (its dataset/cache_io.py:
// save_latent_cache_qwen_image and save_text_encoder_output_cache_qwen_image, made by
// qwen_image_cache_latents.py and qwen_image_cache_text_encoder_outputs.py with
// --cache_directory), one pair of safetensors files per image:
//
//   NAME_WWWWxHHHH_qi.safetensors  latents_1x{h}x{w}_{dtype}: [16, 1, h, w], the VAE's latents
//                                  (h, w: the bucket's height and width / 8; WWWWxHHHH is the
//                                  image's original size). Metadata: architecture
//                                  "qwen_image", width, height, format_version
//   NAME_qi_te.safetensors         varlen_vl_embed_{dtype}: [L, 3584], Qwen2.5-VL's hidden
//                                  states of the caption's L tokens (the prompt template's
//                                  first 34 dropped, the padding cut off: L varies by
//                                  caption). Metadata: architecture "qwen_image", caption1
//
// {dtype} is torch's name (bfloat16, float16, float32). Images batch by bucket (latent size);
// captions of several lengths in one batch are padded and masked, as musubi batches them.
// Control latents (latents_control_*: Qwen-Image-Edit) are refused. Torch-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/base/dtype.h"

namespace lorastream {

inline constexpr int64_t kMaxQwenImageLatentSide = 512;   // 4096 pixels a side
inline constexpr int64_t kMaxQwenImageTextTokens = 4096;  // Qwen-Image's prompts: up to 1024

struct QwenImageCacheItem {
  std::string name;          // NAME
  std::string latents_path;  // NAME_WWWWxHHHH_qi.safetensors
  std::string te_path;       // NAME_qi_te.safetensors
};

// Every image of `dir`, sorted by name. Refused (kCorrupt, naming the file) when a latent
// file has no text-encoder file beside it; kNotFound when the folder holds no latent file.
std::vector<QwenImageCacheItem> ScanQwenImageCache(const std::string& dir);

// One image's two files checked against the model (latent channels, text width): every
// mismatch is Error(kCorrupt) naming the file and the tensor or metadata key.
struct QwenImageCacheCheck {
  std::string latent_key, embed_key;  // the tensors' names in their files
  DType latent_dtype = DType::kF32, embed_dtype = DType::kF32;
  int64_t latent_h = 0, latent_w = 0, txt_len = 0;
};
QwenImageCacheCheck CheckQwenImageCache(const QwenImageCacheItem& item, int64_t latent_channels,
                                        int64_t joint_attention_dim);

// Writes one image's two files of deterministic random values (N(0, 1)) in musubi's layout,
// in `dtype` (F32 or BF16), for demos and tests: a bucket of width x height pixels (multiples
// of 16), `txt_len` text tokens of `joint_dim` features.
void WriteQwenImageCacheFiles(const std::string& dir, const std::string& name, int64_t width,
                              int64_t height, int64_t txt_len, int64_t joint_dim, uint64_t seed,
                              DType dtype = DType::kBF16);

}  // namespace lorastream
