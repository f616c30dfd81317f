// The caches FLUX.1 trainers write, read as they are (sd-scripts' library/strategy_flux.py,
// made by its cache_latents.py and cache_text_encoder_outputs.py, or by flux_train_network.py
// with --cache_latents_to_disk and --cache_text_encoder_outputs_to_disk):
//
//   NAME_WWWWxHHHH_flux.npz  latents_{h}x{w}: float [16, h, w], the VAE's latents already
//                            scaled and shifted (h = H/8, w = W/8 for an image bucket of W x H
//                            pixels); original_size_*, crop_ltrb_* (not used here)
//   NAME_flux_te.npz         l_pooled [768] (CLIP-L pooled), t5_out [L, 4096] (T5-XXL),
//                            txt_ids [L, 3], t5_attn_mask [L], apply_t5_attn_mask (bool)
//
// A cache folder holds many images; images of one bucket (resolution) batch together.
// Torch-free: arrays are read through common/formats/npz.h.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace lorastream {

// What a cache may declare, checked before anything of its size is allocated: FLUX.1 is
// trained at up to about 2 MP (sd-scripts' buckets reach 2048 a side), and FLUX.1-dev's T5
// reads at most 512 tokens (t5xxl_max_token_length; schnell 256). A bucket or a text longer
// than these is refused naming the file, the value and the limit.
inline constexpr int64_t kMaxFluxBucketSide = 2048;  // pixels, each of width and height
inline constexpr int64_t kMaxFluxTextTokens = 512;

struct FluxCacheItem {
  std::string name;               // NAME
  std::string latents_path;       // NAME_WWWWxHHHH_flux.npz
  std::string te_path;            // NAME_flux_te.npz
  int64_t width = 0, height = 0;  // the bucket in pixels, from the file name
};

// Every image of `dir`, sorted by name. Refused (kCorrupt, naming the file) when a latent
// file has no text-encoder file beside it or its bucket is above kMaxFluxBucketSide; kNotFound
// when the folder holds no latent file.
std::vector<FluxCacheItem> ScanFluxCache(const std::string& dir);

// Items grouped by bucket ((height, width) in pixels), each group in name order.
std::map<std::pair<int64_t, int64_t>, std::vector<FluxCacheItem>> FluxBuckets(
    const std::vector<FluxCacheItem>& items);

struct FluxSample {
  int64_t channels = 0, latent_h = 0, latent_w = 0;
  std::vector<float> latents;  // [channels, latent_h, latent_w]
  int64_t txt_len = 0, context_dim = 0, vec_dim = 0;
  std::vector<float> t5_out;    // [txt_len, context_dim]
  std::vector<float> txt_ids;   // [txt_len, 3]
  std::vector<float> l_pooled;  // [vec_dim]
};

// Reads and checks one image's two files against the model's expectations (16 latent
// channels, the model's text and pooled widths, even latent sizes matching the bucket).
// Every mismatch is Error(kCorrupt) naming the file and the array.
FluxSample LoadFluxSample(const FluxCacheItem& item, int64_t latent_channels, int64_t context_dim,
                          int64_t vec_dim);

// Writes one image's two cache files of deterministic random values (N(0, 1) latents and text
// features, zero txt_ids) in the layout above: demos (`lorastream-synth --flux-caches`) and
// tests. compressed: deflated members, as numpy.savez_compressed writes them.
struct FluxCacheShape {
  int64_t channels = 16, txt_len = 8, context_dim = 4096, vec_dim = 768;
};
void WriteFluxCacheFiles(const std::string& dir, const std::string& name, int64_t width,
                         int64_t height, const FluxCacheShape& shape, uint64_t seed,
                         bool compressed = false);

}  // namespace lorastream
