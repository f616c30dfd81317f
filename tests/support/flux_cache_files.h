// Writes sd-scripts-style FLUX caches (common/flux_cache.h) of deterministic random values:
// NAME_WWWWxHHHH_flux.npz and NAME_flux_te.npz, as its caching scripts lay them out.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/npz.h"

namespace lorastream::testing {

// The message of the lorastream::Error that `f` throws; "" when it throws none.
inline std::string ErrorMessageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline NpyArray FloatArray(std::vector<int64_t> shape, uint64_t seed, float scale = 1.0f) {
  NpyArray a;
  a.kind = 'f';
  a.itemsize = 4;
  a.shape = std::move(shape);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(a.numel()));
  for (auto& x : v) x = dist(rng);
  a.data.resize(v.size() * 4);
  std::memcpy(a.data.data(), v.data(), a.data.size());
  return a;
}

struct FluxCacheShape {
  int64_t channels = 16, txt_len = 8, context_dim = 48, vec_dim = 32;
};

// The latent file's name for an image `name` of width x height pixels.
inline std::string FluxLatentFile(const std::string& name, int64_t width, int64_t height) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "_%04ldx%04ld_flux.npz", static_cast<long>(width),
                static_cast<long>(height));
  return name + buf;
}

inline void WriteFluxCache(const std::string& dir, const std::string& name, int64_t width,
                           int64_t height, const FluxCacheShape& s, uint64_t seed,
                           bool compressed = false) {
  const int64_t h = height / 8, w = width / 8;
  WriteNpz(
      dir + "/" + FluxLatentFile(name, width, height),
      {{"latents_" + std::to_string(h) + "x" + std::to_string(w),
        FloatArray({s.channels, h, w}, seed)},
       {"original_size_" + std::to_string(h) + "x" + std::to_string(w), FloatArray({2}, seed + 1)}},
      compressed);
  NpyArray ids;
  ids.kind = 'f';
  ids.itemsize = 4;
  ids.shape = {s.txt_len, 3};
  ids.data.assign(static_cast<size_t>(s.txt_len * 3 * 4), 0);
  NpyArray mask;
  mask.kind = 'i';
  mask.itemsize = 8;
  mask.shape = {s.txt_len};
  mask.data.assign(static_cast<size_t>(s.txt_len * 8), 0);
  NpyArray apply;
  apply.kind = 'b';
  apply.itemsize = 1;
  apply.data = {0};
  WriteNpz(dir + "/" + name + "_flux_te.npz",
           {{"l_pooled", FloatArray({s.vec_dim}, seed + 2)},
            {"t5_out", FloatArray({s.txt_len, s.context_dim}, seed + 3)},
            {"txt_ids", ids},
            {"t5_attn_mask", mask},
            {"apply_t5_attn_mask", apply}},
           compressed);
}

}  // namespace lorastream::testing
