// Writes sd-scripts-style FLUX caches (common/formats/flux_cache.h) of deterministic random values:
// NAME_WWWWxHHHH_flux.npz and NAME_flux_te.npz, as its caching scripts lay them out.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/base/error.h"
#include "common/formats/flux_cache.h"
#include "common/formats/npz.h"

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

using lorastream::FluxCacheShape;

// The test caches: FLUX-shaped with the tiny models' widths (flux-tiny: 48 and 32).
inline FluxCacheShape TinyCacheShape() {
  FluxCacheShape s;
  s.context_dim = 48;
  s.vec_dim = 32;
  return s;
}

inline void WriteFluxCache(const std::string& dir, const std::string& name, int64_t width,
                           int64_t height, const FluxCacheShape& s, uint64_t seed,
                           bool compressed = false) {
  WriteFluxCacheFiles(dir, name, width, height, s, seed, compressed);
}

}  // namespace lorastream::testing
