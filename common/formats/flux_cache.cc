#include "common/formats/flux_cache.h"

#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <regex>
#include <set>

#include "common/base/error.h"
#include "common/formats/npz.h"

namespace lorastream {

namespace {

[[noreturn]] void Corrupt(const std::string& file, const std::string& why) {
  throw Error(ErrorCode::kCorrupt, file + ": " + why);
}

std::string Shape(const NpyArray& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(a.shape[i]);
  return s + "]";
}

// The key by value: a reference parameter bound to a temporary string would make GCC 13 take
// the returned reference (into `npz`) for a dangling one.
const NpyArray& Need(const std::map<std::string, NpyArray>& npz, const std::string& file,
                     std::string key, size_t rank) {
  auto it = npz.find(key);
  if (it == npz.end()) Corrupt(file, "no array `" + key + "`");
  if (it->second.shape.size() != rank)
    Corrupt(file, "array `" + key + "` has shape " + Shape(it->second) + ", expected rank " +
                      std::to_string(rank));
  return it->second;
}

}  // namespace

std::vector<FluxCacheItem> ScanFluxCache(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw Error(ErrorCode::kNotFound, dir + ": the cache folder cannot be opened");
  std::set<std::string> names;
  while (dirent* e = ::readdir(d)) names.insert(e->d_name);
  ::closedir(d);
  static const std::regex kLatents(R"((.+)_(\d{4,})x(\d{4,})_flux\.npz)");
  std::vector<FluxCacheItem> out;
  for (const auto& n : names) {
    std::smatch m;
    if (!std::regex_match(n, m, kLatents)) continue;
    FluxCacheItem item;
    item.name = m[1];
    item.latents_path = dir + "/" + n;
    // The bucket from the name, bounded before it sizes anything (and before stoll could
    // overflow on a long run of digits).
    const auto side = [&](const std::string& digits) -> int64_t {
      return digits.size() > 9 ? std::numeric_limits<int64_t>::max() : std::stoll(digits);
    };
    item.width = side(m[2]);
    item.height = side(m[3]);
    if (item.width > kMaxFluxBucketSide || item.height > kMaxFluxBucketSide)
      Corrupt(item.latents_path, "bucket " + std::string(m[2]) + "x" + std::string(m[3]) +
                                     " is above the limit of " +
                                     std::to_string(kMaxFluxBucketSide) +
                                     " pixels a side (FLUX.1 trains at up to about 2 MP)");
    const std::string te = item.name + "_flux_te.npz";
    if (!names.count(te))
      Corrupt(item.latents_path, "no text-encoder file " + te +
                                     " beside it (cache the text encoders' outputs with "
                                     "sd-scripts' cache_text_encoder_outputs.py)");
    item.te_path = dir + "/" + te;
    out.push_back(item);
  }
  if (out.empty())
    throw Error(ErrorCode::kNotFound, dir + ": no latent cache (NAME_WWWWxHHHH_flux.npz) in it");
  return out;
}

std::map<std::pair<int64_t, int64_t>, std::vector<FluxCacheItem>> FluxBuckets(
    const std::vector<FluxCacheItem>& items) {
  std::map<std::pair<int64_t, int64_t>, std::vector<FluxCacheItem>> out;
  for (const auto& i : items) out[{i.height, i.width}].push_back(i);
  return out;
}

FluxSample LoadFluxSample(const FluxCacheItem& item, int64_t latent_channels, int64_t context_dim,
                          int64_t vec_dim) {
  FluxSample s;
  if (item.width > kMaxFluxBucketSide || item.height > kMaxFluxBucketSide || item.width < 16 ||
      item.height < 16)
    Corrupt(item.latents_path, "bucket " + std::to_string(item.width) + "x" +
                                   std::to_string(item.height) + " is outside 16.." +
                                   std::to_string(kMaxFluxBucketSide) + " pixels a side");
  // What the two files may hold at most (8-byte elements, every member the trainers write:
  // the latents, and an alpha mask of the image's pixels), so that a member declaring more is
  // refused before it is inflated.
  const uint64_t kSlack = 1 << 20;
  const uint64_t pixels = static_cast<uint64_t>(item.height) * static_cast<uint64_t>(item.width);
  const uint64_t latents_limit =
      (static_cast<uint64_t>(latent_channels) * (pixels / 64) + pixels) * 8 + kSlack;
  const uint64_t te_limit =
      static_cast<uint64_t>(kMaxFluxTextTokens) * (context_dim + 3 + 1) * 8 + vec_dim * 8 + kSlack;
  {
    const auto npz = ReadNpz(item.latents_path, latents_limit);
    const std::string key =
        "latents_" + std::to_string(item.height / 8) + "x" + std::to_string(item.width / 8);
    if (item.height % 16 || item.width % 16)
      Corrupt(item.latents_path, "bucket " + std::to_string(item.width) + "x" +
                                     std::to_string(item.height) +
                                     " is not a multiple of 16 pixels (FLUX packs 2x2 latents)");
    const NpyArray& a = Need(npz, item.latents_path, key, 3);
    if (a.shape[0] != latent_channels || a.shape[1] != item.height / 8 ||
        a.shape[2] != item.width / 8)
      Corrupt(item.latents_path, "array `" + key + "` has shape " + Shape(a) + ", expected [" +
                                     std::to_string(latent_channels) + ", " +
                                     std::to_string(item.height / 8) + ", " +
                                     std::to_string(item.width / 8) + "] (FLUX.1's VAE latents)");
    s.channels = a.shape[0];
    s.latent_h = a.shape[1];
    s.latent_w = a.shape[2];
    s.latents = a.ToFloat(item.latents_path + ": " + key);
  }
  const auto npz = ReadNpz(item.te_path, te_limit);
  const NpyArray& t5 = Need(npz, item.te_path, "t5_out", 2);
  if (t5.shape[0] > kMaxFluxTextTokens || t5.shape[0] < 1)
    Corrupt(item.te_path, "array `t5_out` has " + std::to_string(t5.shape[0]) +
                              " text tokens, outside 1.." + std::to_string(kMaxFluxTextTokens) +
                              " (FLUX.1-dev's T5 reads at most 512)");
  const NpyArray& ids = Need(npz, item.te_path, "txt_ids", 2);
  const NpyArray& pooled = Need(npz, item.te_path, "l_pooled", 1);
  if (t5.shape[1] != context_dim)
    Corrupt(item.te_path, "array `t5_out` has shape " + Shape(t5) + ", the model reads " +
                              std::to_string(context_dim) + " features per text token");
  if (ids.shape[0] != t5.shape[0] || ids.shape[1] != 3)
    Corrupt(item.te_path, "array `txt_ids` has shape " + Shape(ids) + ", expected [" +
                              std::to_string(t5.shape[0]) + ", 3]");
  if (pooled.shape[0] != vec_dim)
    Corrupt(item.te_path, "array `l_pooled` has shape " + Shape(pooled) + ", the model reads " +
                              std::to_string(vec_dim));
  if (auto it = npz.find("apply_t5_attn_mask"); it != npz.end()) {
    const auto v = it->second.ToFloat(item.te_path + ": apply_t5_attn_mask");
    if (!v.empty() && v[0] != 0)
      throw Error(ErrorCode::kUnsupported,
                  item.te_path +
                      ": cached with apply_t5_attn_mask, which is not trained here "
                      "(cache without --apply_t5_attn_mask)");
  }
  s.txt_len = t5.shape[0];
  s.context_dim = t5.shape[1];
  s.vec_dim = pooled.shape[0];
  s.t5_out = t5.ToFloat(item.te_path + ": t5_out");
  s.txt_ids = ids.ToFloat(item.te_path + ": txt_ids");
  s.l_pooled = pooled.ToFloat(item.te_path + ": l_pooled");
  return s;
}

namespace {

NpyArray Array(char kind, int itemsize, std::vector<int64_t> shape) {
  NpyArray a;
  a.kind = kind;
  a.itemsize = itemsize;
  a.shape = std::move(shape);
  a.data.assign(static_cast<size_t>(a.numel() * itemsize), 0);
  return a;
}

NpyArray Normal(std::vector<int64_t> shape, uint64_t seed) {
  NpyArray a = Array('f', 4, std::move(shape));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (size_t i = 0; i < a.data.size(); i += 4) {
    const float v = dist(rng);
    std::memcpy(a.data.data() + i, &v, 4);
  }
  return a;
}

}  // namespace

void WriteFluxCacheFiles(const std::string& dir, const std::string& name, int64_t width,
                         int64_t height, const FluxCacheShape& s, uint64_t seed, bool compressed) {
  const int64_t h = height / 8, w = width / 8;
  const std::string key = std::to_string(h) + "x" + std::to_string(w);
  char size[32];
  std::snprintf(size, sizeof(size), "_%04lldx%04lld", static_cast<long long>(width),
                static_cast<long long>(height));
  NpyArray original = Array('i', 8, {2});
  const int64_t hw[2] = {height, width};
  std::memcpy(original.data.data(), hw, 16);
  WriteNpz(
      dir + "/" + name + size + "_flux.npz",
      {{"latents_" + key, Normal({s.channels, h, w}, seed)}, {"original_size_" + key, original}},
      compressed);
  WriteNpz(dir + "/" + name + "_flux_te.npz",
           {{"l_pooled", Normal({s.vec_dim}, seed + 1)},
            {"t5_out", Normal({s.txt_len, s.context_dim}, seed + 2)},
            {"txt_ids", Array('f', 4, {s.txt_len, 3})},
            {"t5_attn_mask", Array('i', 8, {s.txt_len})},
            {"apply_t5_attn_mask", Array('b', 1, {})}},
           compressed);
}

}  // namespace lorastream
