#include "common/formats/qwen_image_cache.h"

#include <dirent.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <regex>
#include <set>
#include <tuple>

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
    Corrupt(f.path(), "metadata `architecture` is `" + it->second +
                          "`, not `qwen_image` (musubi-tuner's for Qwen-Image and "
                          "Qwen-Image-Edit caches alike)");
}

// The dtype a tensor's name ends in (musubi's keys: ..._{dtype}), checked against its own.
DType NamedDType(const SafetensorsFile& f, const SafetensorsEntry& e) {
  DType dtype;
  const std::string suffix = e.name.substr(e.name.rfind('_') + 1);
  if (!DTypeOfTorchName(suffix, &dtype) || e.dtype != dtype)
    Corrupt(f.path(), "tensor `" + e.name + "` is " + DTypeName(e.dtype) +
                          ": its name must end in its dtype (bfloat16, float16 or float32)");
  return dtype;
}

// The text-encoder file's one tensor, varlen_vl_embed_{dtype}.
const SafetensorsEntry& EmbedTensor(const SafetensorsFile& f, DType* dtype) {
  const std::string prefix = "varlen_vl_embed_";
  const SafetensorsEntry* found = nullptr;
  for (const auto& e : f.tensors()) {
    if (e.name.compare(0, prefix.size(), prefix) != 0)
      Corrupt(f.path(), "unexpected tensor `" + e.name + "` (a Qwen-Image cache holds `" + prefix +
                            "{dtype}` alone)");
    if (found != nullptr)
      Corrupt(f.path(), "two tensors `" + found->name + "` and `" + e.name + "`");
    found = &e;
  }
  if (found == nullptr) Corrupt(f.path(), "no tensor `" + prefix + "{dtype}`");
  *dtype = NamedDType(f, *found);
  return *found;
}

// A latent tensor [channels, 1, h, w] named PREFIX1x{h}x{w}_{dtype}: its (h, w), both even and
// within kMaxQwenImageLatentSide.
std::pair<int64_t, int64_t> LatentSize(const SafetensorsFile& f, const SafetensorsEntry& e,
                                       const std::string& prefix, int64_t channels, DType* dtype) {
  *dtype = NamedDType(f, e);
  const auto& s = e.shape;
  if (s.size() != 4 || s[0] != channels || s[1] != 1)
    Corrupt(f.path(), "tensor `" + e.name + "` has shape " + ShapeString(s) + ", expected [" +
                          std::to_string(channels) + ", 1, h, w]");
  const int64_t h = s[2], w = s[3];
  if (h < 2 || w < 2 || h % 2 || w % 2 || h > kMaxQwenImageLatentSide ||
      w > kMaxQwenImageLatentSide)
    Corrupt(f.path(), "tensor `" + e.name + "`: latent " + std::to_string(h) + "x" +
                          std::to_string(w) + " is not even or not in [2, " +
                          std::to_string(kMaxQwenImageLatentSide) + "] a side");
  const std::string want =
      prefix + "1x" + std::to_string(h) + "x" + std::to_string(w) + "_" + TorchName(*dtype);
  if (e.name != want)
    Corrupt(f.path(), "tensor `" + e.name + "` of shape " + ShapeString(s) +
                          " is not named for it (`" + want + "`)");
  return {h, w};
}

// The index i of musubi's control key latents_control_{i}_..., or -1 when it has none.
int64_t ControlIndex(const std::string& name) {
  static const std::regex kControl(R"(latents_control_(\d{1,3})_.*)");
  std::smatch m;
  if (!std::regex_match(name, m, kControl)) return -1;
  return std::stoll(m[1]);
}

const char* const kControlPrefix = "latents_control_";

uint16_t Bf16Bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

std::vector<QwenImageCacheItem> ScanQwenImageCache(const std::string& dir, bool edit) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw Error(ErrorCode::kNotFound, dir + ": the cache folder cannot be opened");
  std::set<std::string> names;
  while (dirent* e = ::readdir(d)) names.insert(e->d_name);
  ::closedir(d);
  // musubi's dataset architecture in the names: "qi" (Qwen-Image), "qie" (Qwen-Image-Edit).
  static const std::regex kLatents(R"((.+)_(\d{4,})x(\d{4,})_(qie?)\.safetensors)");
  const std::string arch = edit ? "qie" : "qi";
  std::vector<QwenImageCacheItem> out;
  std::string other;  // a latent file of the other kind
  for (const auto& n : names) {
    std::smatch m;
    if (!std::regex_match(n, m, kLatents)) continue;
    if (m[4] != arch) {
      if (other.empty()) other = dir + "/" + n;
      continue;
    }
    QwenImageCacheItem item;
    item.name = m[1];
    item.latents_path = dir + "/" + n;
    item.edit = edit;
    const std::string te = item.name + "_" + arch + "_te.safetensors";
    if (!names.count(te))
      Corrupt(item.latents_path, "no text-encoder file " + te +
                                     " beside it (cache the captions with musubi-tuner's "
                                     "qwen_image_cache_text_encoder_outputs.py" +
                                     (edit ? " --model_version edit)" : ")"));
    item.te_path = dir + "/" + te;
    out.push_back(item);
  }
  if (out.empty() && !other.empty())
    throw Error(ErrorCode::kNotFound,
                edit ? dir +
                           ": `qwen_image.edit = true` but the folder holds Qwen-Image caches "
                           "without control images (" +
                           other +
                           "), no Qwen-Image-Edit cache (NAME_WWWWxHHHH_qie.safetensors: "
                           "musubi-tuner's caching scripts with --model_version edit)"
                     : dir + ": the folder holds Qwen-Image-Edit caches (" + other +
                           ", control latents), no Qwen-Image cache "
                           "(NAME_WWWWxHHHH_qi.safetensors): set `qwen_image.edit = true` to "
                           "train an Edit LoRA on them");
  if (out.empty())
    throw Error(
        ErrorCode::kNotFound,
        dir + (edit ? ": no Qwen-Image-Edit latent cache (NAME_WWWWxHHHH_qie.safetensors) "
                      "in it"
                    : ": no Qwen-Image latent cache (NAME_WWWWxHHHH_qi.safetensors) in it"));
  return out;
}

QwenImageCacheCheck CheckQwenImageCache(const QwenImageCacheItem& item, int64_t latent_channels,
                                        int64_t joint_attention_dim) {
  QwenImageCacheCheck c;
  {
    const SafetensorsFile f = SafetensorsFile::Open(item.latents_path);
    RequireArchitecture(f);
    const SafetensorsEntry* target = nullptr;
    std::vector<const SafetensorsEntry*> controls;  // by index
    for (const auto& e : f.tensors()) {
      if (e.name.compare(0, std::strlen(kControlPrefix), kControlPrefix) == 0) {
        if (!item.edit)
          Corrupt(f.path(), "tensor `" + e.name +
                                "`: control latents in a Qwen-Image cache (an Edit LoRA trains "
                                "on musubi-tuner's Qwen-Image-Edit caches, _qie, with "
                                "`qwen_image.edit = true`)");
        const int64_t i = ControlIndex(e.name);
        if (i < 0 || i >= kMaxQwenImageControls)
          Corrupt(f.path(), "tensor `" + e.name + "`: not a control latent of index 0 to " +
                                std::to_string(kMaxQwenImageControls - 1) +
                                " (latents_control_{i}_1x{h}x{w}_{dtype})");
        if (controls.size() <= static_cast<size_t>(i)) controls.resize(i + 1, nullptr);
        if (controls[i] != nullptr)
          Corrupt(f.path(), "two tensors `" + controls[i]->name + "` and `" + e.name + "`");
        controls[i] = &e;
        continue;
      }
      if (e.name.compare(0, 8, "latents_") != 0)
        Corrupt(f.path(), "unexpected tensor `" + e.name +
                              "` (a Qwen-Image cache holds `latents_{dtype}`" +
                              (item.edit ? " and its control latents)" : " alone)"));
      if (target != nullptr)
        Corrupt(f.path(), "two tensors `" + target->name + "` and `" + e.name + "`");
      target = &e;
    }
    if (target == nullptr) Corrupt(f.path(), "no tensor `latents_1x{h}x{w}_{dtype}`");
    std::tie(c.latent_h, c.latent_w) =
        LatentSize(f, *target, "latents_", latent_channels, &c.latent_dtype);
    c.latent_key = target->name;
    if (item.edit && controls.empty())
      Corrupt(f.path(),
              "no control latents (`latents_control_0_1x{h}x{w}_{dtype}`): an edit "
              "job trains on images with their control images");
    for (size_t i = 0; i < controls.size(); ++i) {
      const std::string prefix = kControlPrefix + std::to_string(i) + "_";
      if (controls[i] == nullptr)
        Corrupt(f.path(), "no tensor `" + prefix +
                              "1x{h}x{w}_{dtype}` though a later control's "
                              "is there (the controls are numbered from 0)");
      DType dtype;
      c.control_sizes.push_back(LatentSize(f, *controls[i], prefix, latent_channels, &dtype));
      c.control_keys.push_back(controls[i]->name);
    }
  }
  const SafetensorsFile f = SafetensorsFile::Open(item.te_path);
  RequireArchitecture(f);
  const SafetensorsEntry& e = EmbedTensor(f, &c.embed_dtype);
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
                              DType dtype,
                              const std::vector<std::pair<int64_t, int64_t>>& controls) {
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
  const std::string arch = controls.empty() ? "qi" : "qie";
  std::vector<std::vector<uint8_t>> data{values(16 * h * w)};
  std::vector<TensorToWrite> tensors{
      {"latents_1x" + std::to_string(h) + "x" + std::to_string(w) + "_" + t,
       dtype,
       {16, 1, h, w},
       nullptr}};
  data.reserve(controls.size() + 1);
  for (size_t i = 0; i < controls.size(); ++i) {
    const int64_t ch = controls[i].second / 8, cw = controls[i].first / 8;
    data.push_back(values(16 * ch * cw));
    tensors.push_back({kControlPrefix + std::to_string(i) + "_1x" + std::to_string(ch) + "x" +
                           std::to_string(cw) + "_" + t,
                       dtype,
                       {16, 1, ch, cw},
                       nullptr});
  }
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = data[i].data();
  WriteSafetensors(dir + "/" + name + "_" + size + "_" + arch + ".safetensors", tensors,
                   {{"architecture", "qwen_image"},
                    {"width", std::to_string(width)},
                    {"height", std::to_string(height)},
                    {"format_version", "1.0.1"}});
  const auto emb = values(txt_len * joint_dim);
  WriteSafetensors(dir + "/" + name + "_" + arch + "_te.safetensors",
                   {{"varlen_vl_embed_" + t, dtype, {txt_len, joint_dim}, emb.data()}},
                   {{"architecture", "qwen_image"},
                    {"caption1", "a caption of " + name},
                    {"format_version", "1.0.1"}});
}

}  // namespace lorastream
