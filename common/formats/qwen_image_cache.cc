#include "common/formats/qwen_image_cache.h"

#include <dirent.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <regex>
#include <set>

#include "common/base/error.h"
#include "common/formats/safetensors.h"

namespace lorastream {

namespace {

[[noreturn]] void Corrupt(const std::string& file, const std::string& why) {
  throw Error(ErrorCode::kCorrupt, file + ": " + why);
}

// torch's dtype names as musubi writes them in its keys.
bool DTypeOfTorchName(const std::string& name, DType* out) {
  static const std::map<std::string, DType> kNames = {
      {"bfloat16", DType::kBF16}, {"float16", DType::kF16}, {"float32", DType::kF32}};
  auto it = kNames.find(name);
  if (it == kNames.end()) return false;
  *out = it->second;
  return true;
}

std::string TorchName(DType d) {
  return d == DType::kBF16 ? "bfloat16" : d == DType::kF16 ? "float16" : "float32";
}

// The file's metadata `architecture` must be "qwen_image".
void RequireArchitecture(const SafetensorsFile& f) {
  auto it = f.header().metadata.find("architecture");
  if (it == f.header().metadata.end())
    Corrupt(f.path(), "no metadata `architecture` (not a musubi-tuner cache)");
  if (it->second != "qwen_image")
    Corrupt(f.path(),
            "metadata `architecture` is `" + it->second + "`, not `qwen_image`" +
                (it->second == "qwen_image_edit" ? " (Qwen-Image-Edit caches are not trained here)"
                                                 : ""));
}

// The one tensor of `f` whose name is PREFIX + {dtype} (musubi's key), its dtype checked.
const SafetensorsEntry& OneTensor(const SafetensorsFile& f, const std::string& prefix,
                                  DType* dtype) {
  const SafetensorsEntry* found = nullptr;
  for (const auto& e : f.tensors()) {
    if (e.name.compare(0, 16, "latents_control_") == 0)
      Corrupt(f.path(), "tensor `" + e.name +
                            "`: control latents (a Qwen-Image-Edit cache) are not trained here");
    if (e.name.compare(0, prefix.size(), prefix) != 0)
      Corrupt(f.path(), "unexpected tensor `" + e.name + "` (a Qwen-Image cache holds `" + prefix +
                            "{dtype}` alone)");
    if (found != nullptr)
      Corrupt(f.path(), "two tensors `" + found->name + "` and `" + e.name + "`");
    found = &e;
  }
  if (found == nullptr) Corrupt(f.path(), "no tensor `" + prefix + "{dtype}`");
  const std::string suffix = found->name.substr(found->name.rfind('_') + 1);
  if (!DTypeOfTorchName(suffix, dtype) || found->dtype != *dtype)
    Corrupt(f.path(), "tensor `" + found->name + "` is " + DTypeName(found->dtype) +
                          ": its name must end in its dtype (bfloat16, float16 or float32)");
  return *found;
}

uint16_t Bf16Bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

std::vector<QwenImageCacheItem> ScanQwenImageCache(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw Error(ErrorCode::kNotFound, dir + ": the cache folder cannot be opened");
  std::set<std::string> names;
  while (dirent* e = ::readdir(d)) names.insert(e->d_name);
  ::closedir(d);
  static const std::regex kLatents(R"((.+)_(\d{4,})x(\d{4,})_qi\.safetensors)");
  std::vector<QwenImageCacheItem> out;
  for (const auto& n : names) {
    std::smatch m;
    if (!std::regex_match(n, m, kLatents)) continue;
    QwenImageCacheItem item;
    item.name = m[1];
    item.latents_path = dir + "/" + n;
    const std::string te = item.name + "_qi_te.safetensors";
    if (!names.count(te))
      Corrupt(item.latents_path, "no text-encoder file " + te +
                                     " beside it (cache the captions with musubi-tuner's "
                                     "qwen_image_cache_text_encoder_outputs.py)");
    item.te_path = dir + "/" + te;
    out.push_back(item);
  }
  if (out.empty())
    throw Error(ErrorCode::kNotFound,
                dir + ": no Qwen-Image latent cache (NAME_WWWWxHHHH_qi.safetensors) in it");
  return out;
}

QwenImageCacheCheck CheckQwenImageCache(const QwenImageCacheItem& item, int64_t latent_channels,
                                        int64_t joint_attention_dim) {
  QwenImageCacheCheck c;
  {
    const SafetensorsFile f = SafetensorsFile::Open(item.latents_path);
    RequireArchitecture(f);
    const SafetensorsEntry& e = OneTensor(f, "latents_", &c.latent_dtype);
    c.latent_key = e.name;
    const auto& s = e.shape;
    if (s.size() != 4 || s[0] != latent_channels || s[1] != 1)
      Corrupt(f.path(), "tensor `" + e.name + "` has shape " + ShapeString(s) + ", expected [" +
                            std::to_string(latent_channels) + ", 1, h, w]");
    c.latent_h = s[2];
    c.latent_w = s[3];
    if (c.latent_h < 2 || c.latent_w < 2 || c.latent_h % 2 || c.latent_w % 2 ||
        c.latent_h > kMaxQwenImageLatentSide || c.latent_w > kMaxQwenImageLatentSide)
      Corrupt(f.path(), "tensor `" + e.name + "`: latent " + std::to_string(c.latent_h) + "x" +
                            std::to_string(c.latent_w) + " is not even or not in [2, " +
                            std::to_string(kMaxQwenImageLatentSide) + "] a side");
    const std::string want = "latents_1x" + std::to_string(c.latent_h) + "x" +
                             std::to_string(c.latent_w) + "_" + TorchName(c.latent_dtype);
    if (e.name != want)
      Corrupt(f.path(), "tensor `" + e.name + "` of shape " + ShapeString(s) +
                            " is not named for it (`" + want + "`)");
  }
  const SafetensorsFile f = SafetensorsFile::Open(item.te_path);
  RequireArchitecture(f);
  const SafetensorsEntry& e = OneTensor(f, "varlen_vl_embed_", &c.embed_dtype);
  c.embed_key = e.name;
  if (e.shape.size() != 2 || e.shape[1] != joint_attention_dim || e.shape[0] < 1 ||
      e.shape[0] > kMaxQwenImageTextTokens)
    Corrupt(f.path(), "tensor `" + e.name + "` has shape " + ShapeString(e.shape) +
                          ", expected [L, " + std::to_string(joint_attention_dim) +
                          "] with L in [1, " + std::to_string(kMaxQwenImageTextTokens) + "]");
  c.txt_len = e.shape[0];
  return c;
}

void WriteQwenImageCacheFiles(const std::string& dir, const std::string& name, int64_t width,
                              int64_t height, int64_t txt_len, int64_t joint_dim, uint64_t seed,
                              DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kBF16)
    throw Error(ErrorCode::kInvalidArgument, "Qwen-Image caches are written in f32 or bf16");
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  auto values = [&](int64_t n) {
    std::vector<uint8_t> out(static_cast<size_t>(n) * DTypeSize(dtype));
    for (int64_t i = 0; i < n; ++i) {
      const float v = normal(rng);
      if (dtype == DType::kF32)
        std::memcpy(out.data() + 4 * i, &v, 4);
      else {
        const uint16_t b = Bf16Bits(v);
        std::memcpy(out.data() + 2 * i, &b, 2);
      }
    }
    return out;
  };
  const int64_t h = height / 8, w = width / 8;
  const std::string t = TorchName(dtype);
  char size[32];
  std::snprintf(size, sizeof size, "%04lldx%04lld", static_cast<long long>(width),
                static_cast<long long>(height));
  const auto lat = values(16 * h * w);
  WriteSafetensors(dir + "/" + name + "_" + size + "_qi.safetensors",
                   {{"latents_1x" + std::to_string(h) + "x" + std::to_string(w) + "_" + t,
                     dtype,
                     {16, 1, h, w},
                     lat.data()}},
                   {{"architecture", "qwen_image"},
                    {"width", std::to_string(width)},
                    {"height", std::to_string(height)},
                    {"format_version", "1.0.1"}});
  const auto emb = values(txt_len * joint_dim);
  WriteSafetensors(dir + "/" + name + "_qi_te.safetensors",
                   {{"varlen_vl_embed_" + t, dtype, {txt_len, joint_dim}, emb.data()}},
                   {{"architecture", "qwen_image"},
                    {"caption1", "a caption of " + name},
                    {"format_version", "1.0.1"}});
}

}  // namespace lorastream
