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
//
// Qwen-Image-Edit's caches (the same scripts with --model_version edit | edit-2509; musubi's
// dataset architecture "qie" names the files, the metadata stays "qwen_image"):
//
//   NAME_WWWWxHHHH_qie.safetensors  latents_1x{h}x{w}_{dtype} as above, and per control image
//                                   i = 0, 1, ...: latents_control_{i}_1x{hc}x{wc}_{dtype}:
//                                   [16, 1, hc, wc] (the control's own size: musubi's
//                                   control_resolution / no_resize_control)
//   NAME_qie_te.safetensors         varlen_vl_embed_{dtype}: the prompt encoded with the control
//                                   images (Qwen2.5-VL sees them)
//
// Images then batch by their bucket and every control's size (musubi's buckets). A plain job
// reads the _qi files and refuses control latents; an edit job reads the _qie files and
// refuses an image without one. Torch-free.
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
inline constexpr int64_t kMaxQwenImageControls = 16;      // Edit-2509: up to 3 (musubi: any)

struct QwenImageCacheItem {
  std::string name;          // NAME
  std::string latents_path;  // NAME_WWWWxHHHH_qi.safetensors (edit: _qie)
  std::string te_path;       // NAME_qi_te.safetensors (edit: _qie_te)
  bool edit = false;         // a Qwen-Image-Edit cache: its control latents are read
};

// Every image of `dir`, sorted by name: the _qi files, or with `edit` (a job's
// `qwen_image.edit`) the _qie files. Refused (kCorrupt, naming the file) when a latent file has
// no text-encoder file beside it; kNotFound when the folder holds no latent file of the kind,
// naming the other kind's file when it holds those (the key and the caches disagree).
std::vector<QwenImageCacheItem> ScanQwenImageCache(const std::string& dir, bool edit = false);

// One image's two files checked against the model (latent channels, text width): every
// mismatch is Error(kCorrupt) naming the file and the tensor or metadata key.
struct QwenImageCacheCheck {
  std::string latent_key, embed_key;  // the tensors' names in their files
  DType latent_dtype = DType::kF32, embed_dtype = DType::kF32;
  int64_t latent_h = 0, latent_w = 0, txt_len = 0;
  // An edit cache's control latents in order (latents_control_0_..., 1, ...): their tensors'
  // names and latent (height, width); empty for a plain cache.
  std::vector<std::string> control_keys;
  std::vector<std::pair<int64_t, int64_t>> control_sizes;
};
QwenImageCacheCheck CheckQwenImageCache(const QwenImageCacheItem& item, int64_t latent_channels,
                                        int64_t joint_attention_dim);

// Writes one image's two files of deterministic random values (N(0, 1)) in musubi's layout,
// in `dtype` (F32 or BF16), for demos and tests: a bucket of width x height pixels (multiples
// of 16), `txt_len` text tokens of `joint_dim` features. With `controls` (each control image's
// width and height in pixels, multiples of 16): an edit cache (_qie) with their latents.
void WriteQwenImageCacheFiles(const std::string& dir, const std::string& name, int64_t width,
                              int64_t height, int64_t txt_len, int64_t joint_dim, uint64_t seed,
                              DType dtype = DType::kBF16,
                              const std::vector<std::pair<int64_t, int64_t>>& controls = {});

}  // namespace lorastream
