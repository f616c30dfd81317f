#include "common/formats/qwen_image_config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool IsFile(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void AddLinear(TensorShapes& out, const std::string& name, int64_t out_dim, int64_t in_dim) {
  out.push_back({name + ".weight", {out_dim, in_dim}});
  out.push_back({name + ".bias", {out_dim}});
}

constexpr const char* kClassName = "QwenImageTransformer2DModel";

// The config.json of the folder (in it or in transformer/) when it is a Qwen-Image one.
std::string QwenConfigPath(const std::string& dir) {
  for (const std::string& cfg : {dir + "/transformer/config.json", dir + "/config.json"}) {
    if (!IsFile(cfg)) continue;
    const auto j = nlohmann::json::parse(ReadRegularFile(cfg, kMaxTextFileBytes), nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.value("_class_name", "") == kClassName) return cfg;
  }
  return "";
}

const std::vector<std::string>& Prefixes() {
  static const std::vector<std::string> p = {"", "diffusion_model.", "model.diffusion_model."};
  return p;
}

}  // namespace

void QwenImageConfig::Validate(const std::string& source) const {
  auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::kCorrupt, source + ": " + why);
  };
  if (num_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0)
    fail(std::to_string(num_heads) + " heads of " + std::to_string(head_dim) +
         ": both must be positive and head_dim even");
  if (axes_dim[0] + axes_dim[1] + axes_dim[2] != head_dim || axes_dim[0] % 2 || axes_dim[1] % 2 ||
      axes_dim[2] % 2 || axes_dim[0] <= 0 || axes_dim[1] <= 0 || axes_dim[2] <= 0)
    fail("RoPE axes_dim " + std::to_string(axes_dim[0]) + "," + std::to_string(axes_dim[1]) + "," +
         std::to_string(axes_dim[2]) + " must be positive, even and sum to head_dim " +
         std::to_string(head_dim));
  if (num_layers < 1 || num_layers > kMaxQwenImageBlocks)
    fail(std::to_string(num_layers) + " blocks: from 1 to " + std::to_string(kMaxQwenImageBlocks));
  if (hidden() > (int64_t{1} << 16) || in_channels <= 0 || in_channels > 4096 ||
      out_channels <= 0 || out_channels > 4096 || joint_attention_dim <= 0 ||
      joint_attention_dim > (int64_t{1} << 16))
    fail("a dimension is out of range (hidden 65536, channels 4096, text width 65536)");
  if (patch_size != 2) fail("patch_size " + std::to_string(patch_size) + " is not 2");
  if (in_channels != patch_size * patch_size * out_channels)
    fail("in_channels " + std::to_string(in_channels) + " is not patch_size^2 x out_channels (" +
         std::to_string(out_dim()) + ")");
}

TensorShapes QwenImageBlockShapes(const QwenImageConfig& c) {
  const int64_t d = c.hidden();
  TensorShapes out;
  AddLinear(out, "img_mod.1", 6 * d, d);
  AddLinear(out, "txt_mod.1", 6 * d, d);
  for (const char* m : {"attn.to_q", "attn.to_k", "attn.to_v"}) AddLinear(out, m, d, d);
  for (const char* m : {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"})
    AddLinear(out, m, d, d);
  for (const char* n : {"attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k"})
    out.push_back({std::string(n) + ".weight", {c.head_dim}});
  AddLinear(out, "attn.to_out.0", d, d);
  AddLinear(out, "attn.to_add_out", d, d);
  for (const char* s : {"img_mlp", "txt_mlp"}) {
    AddLinear(out, std::string(s) + ".net.0.proj", c.mlp_hidden(), d);
    AddLinear(out, std::string(s) + ".net.2", d, c.mlp_hidden());
  }
  return out;
}

TensorShapes QwenImageRestShapes(const QwenImageConfig& c) {
  const int64_t d = c.hidden();
  TensorShapes out;
  AddLinear(out, "img_in", d, c.in_channels);
  out.push_back({"txt_norm.weight", {c.joint_attention_dim}});
  AddLinear(out, "txt_in", d, c.joint_attention_dim);
  AddLinear(out, "time_text_embed.timestep_embedder.linear_1", d, 256);
  AddLinear(out, "time_text_embed.timestep_embedder.linear_2", d, d);
  AddLinear(out, "norm_out.linear", 2 * d, d);
  AddLinear(out, "proj_out", c.out_dim(), d);
  return out;
}

TensorShapes QwenImageUnitShapes(const QwenImageConfig& c, int64_t index) {
  TensorShapes out;
  const std::string prefix = "transformer_blocks." + std::to_string(index) + ".";
  for (auto& [n, s] : QwenImageBlockShapes(c)) out.push_back({prefix + n, s});
  return out;
}

TensorShapes QwenImageAllShapes(const QwenImageConfig& c) {
  TensorShapes out = QwenImageRestShapes(c);
  for (int64_t i = 0; i < c.num_layers; ++i)
    for (auto& t : QwenImageUnitShapes(c, i)) out.push_back(std::move(t));
  return out;
}

std::string QwenImageKeyPrefix(const SafetensorsHeader& header, const std::string& source) {
  for (const std::string& p : Prefixes())
    if (HeaderShape(header, p + "img_in.weight") != nullptr) return p;
  throw Error(ErrorCode::kCorrupt,
              source +
                  ": no tensor `img_in.weight` (bare, or under `diffusion_model.` or "
                  "`model.diffusion_model.`): not a Qwen-Image transformer");
}

QwenImageConfig QwenImageConfigFromHeader(const SafetensorsHeader& header,
                                          const std::string& prefix, const std::string& source) {
  // The header's tensors under their canonical names; a name without the prefix is extra.
  SafetensorsHeader h;
  TensorShapes have;
  for (const auto& t : header.tensors) {
    if (t.name.compare(0, prefix.size(), prefix) != 0)
      throw Error(ErrorCode::kCorrupt, source + ": unexpected tensor `" + t.name +
                                           "` (the others are under `" + prefix +
                                           "`; not part of Qwen-Image's transformer)");
    SafetensorsEntry e = t;
    e.name = t.name.substr(prefix.size());
    have.push_back({e.name, e.shape});
    h.tensors.push_back(std::move(e));
  }
  auto need = [&](const std::string& name, size_t rank) -> const std::vector<int64_t>& {
    const auto* s = HeaderShape(h, name);
    if (s == nullptr)
      throw Error(ErrorCode::kCorrupt, source + ": missing tensor `" + prefix + name + "`");
    if (s->size() != rank)
      throw Error(ErrorCode::kCorrupt, source + ": tensor `" + prefix + name + "` has shape " +
                                           ShapeString(*s) + ", expected rank " +
                                           std::to_string(rank));
    return *s;
  };
  QwenImageConfig c;
  const auto& img_in = need("img_in.weight", 2);
  c.in_channels = img_in[1];
  c.joint_attention_dim = need("txt_in.weight", 2)[1];
  c.head_dim = need("transformer_blocks.0.attn.norm_q.weight", 1)[0];
  if (c.head_dim <= 0 || img_in[0] % c.head_dim != 0)
    throw Error(ErrorCode::kCorrupt, source + ": q norm of " + std::to_string(c.head_dim) +
                                         " does not divide the hidden size " +
                                         std::to_string(img_in[0]));
  c.num_heads = img_in[0] / c.head_dim;
  c.out_channels = need("proj_out.weight", 2)[0] / (c.patch_size * c.patch_size);
  c.num_layers = CountNumberedBlocks(h, "transformer_blocks.", kMaxQwenImageBlocks, source);
  if (auto it = header.metadata.find("qwen_image.axes_dim"); it != header.metadata.end())
    c.axes_dim = ParseAxesDim(it->second, "qwen_image.axes_dim", c.head_dim, source);
  else if (c.head_dim != 128)
    throw Error(ErrorCode::kCorrupt,
                source + ": head_dim " + std::to_string(c.head_dim) +
                    " is not Qwen-Image's 128 and the file's metadata has no qwen_image.axes_dim");
  c.Validate(source);
  RequireExactTensors(have, QwenImageAllShapes(c), source, "Qwen-Image's transformer");
  return c;
}

std::map<std::string, std::string> QwenImageMetadata(const QwenImageConfig& c) {
  return {{"qwen_image.axes_dim", std::to_string(c.axes_dim[0]) + "," +
                                      std::to_string(c.axes_dim[1]) + "," +
                                      std::to_string(c.axes_dim[2])}};
}

std::string QwenImageConfigJson(const QwenImageConfig& c) {
  const nlohmann::json j = {{"_class_name", kClassName},
                            {"_diffusers_version", "0.39.0"},
                            {"patch_size", c.patch_size},
                            {"in_channels", c.in_channels},
                            {"out_channels", c.out_channels},
                            {"num_layers", c.num_layers},
                            {"attention_head_dim", c.head_dim},
                            {"num_attention_heads", c.num_heads},
                            {"joint_attention_dim", c.joint_attention_dim},
                            {"guidance_embeds", false},
                            {"axes_dims_rope", c.axes_dim},
                            {"zero_cond_t", false},
                            {"use_additional_t_cond", false},
                            {"use_layer3d_rope", false}};
  return j.dump(2) + "\n";
}

QwenImageConfig QwenImageConfigFromJson(const std::string& text, const std::string& source) {
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw Error(ErrorCode::kCorrupt, source + ": not a JSON object");
  if (j.value("_class_name", "") != kClassName)
    throw Error(ErrorCode::kUnsupported,
                source + ": `_class_name` is not " + std::string(kClassName));
  auto get = [&](const char* key, int64_t fallback) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1 << 20))
      throw Error(ErrorCode::kCorrupt, source + ": `" + key + "` is not an integer in [0, 2^20]");
    return it->get<int64_t>();
  };
  for (const char* flag :
       {"guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"}) {
    auto it = j.find(flag);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_boolean())
      throw Error(ErrorCode::kCorrupt, source + ": `" + flag + "` is not true or false");
    if (it->get<bool>())
      throw Error(ErrorCode::kUnsupported,
                  source + ": `" + flag +
                      "` is true: that Qwen-Image variant (Edit-2511's zero_cond_t, Layered's "
                      "additional t condition and 3-D layer RoPE) is not computed here");
  }
  QwenImageConfig c;
  c.patch_size = get("patch_size", 2);
  c.in_channels = get("in_channels", 64);
  c.out_channels = get("out_channels", 16);
  if (c.out_channels == 0) c.out_channels = c.in_channels;
  c.num_layers = get("num_layers", 60);
  c.head_dim = get("attention_head_dim", 128);
  c.num_heads = get("num_attention_heads", 24);
  c.joint_attention_dim = get("joint_attention_dim", 3584);
  if (auto it = j.find("axes_dims_rope"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || it->size() != 3)
      throw Error(ErrorCode::kCorrupt, source + ": `axes_dims_rope` is not three integers");
    for (size_t i = 0; i < 3; ++i) {
      if (!(*it)[i].is_number_integer())
        throw Error(ErrorCode::kCorrupt, source + ": `axes_dims_rope` is not three integers");
      c.axes_dim[i] = (*it)[i].get<int64_t>();
    }
  }
  c.Validate(source);
  return c;
}

QwenImageCheckpointKind DetectQwenImageCheckpoint(const std::string& path) {
  if (IsFile(path)) {
    if (!EndsWith(path, ".safetensors"))
      throw Error(ErrorCode::kUnsupported,
                  path +
                      ": not a .safetensors file; Qwen-Image is read from ComfyUI's single file "
                      "(qwen_image_bf16.safetensors) or a diffusers folder");
    return QwenImageCheckpointKind::kSingleFile;
  }
  if (IsDir(path)) {
    if (!QwenConfigPath(path).empty()) return QwenImageCheckpointKind::kDiffusersFolder;
    throw Error(ErrorCode::kUnsupported,
                path + ": a folder without a " + std::string(kClassName) +
                    " config.json (in it or in transformer/); Qwen-Image is read from "
                    "ComfyUI's single file or a diffusers folder");
  }
  throw Error(ErrorCode::kNotFound, path + ": does not exist");
}

bool IsQwenImageCheckpointPath(const std::string& path) {
  if (IsDir(path)) return !QwenConfigPath(path).empty();
  if (!IsFile(path) || !EndsWith(path, ".safetensors")) return false;
  try {
    const SafetensorsFile f = SafetensorsFile::Open(path);
    for (const std::string& p : Prefixes())
      if (f.Find(p + "img_in.weight") != nullptr && f.Find(p + "txt_norm.weight") != nullptr)
        return true;
  } catch (const Error&) {
  }
  return false;
}

std::vector<std::string> QwenImageBlockLinears() {
  return {"img_mod.1",          "txt_mod.1",       "attn.to_q",          "attn.to_k",
          "attn.to_v",          "attn.to_out.0",   "attn.add_q_proj",    "attn.add_k_proj",
          "attn.add_v_proj",    "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
          "txt_mlp.net.0.proj", "txt_mlp.net.2"};
}

std::vector<std::string> QwenImageTargets(const std::vector<std::string>& spec,
                                          const std::string& where) {
  const std::vector<std::string> known = QwenImageBlockLinears();
  if (spec.size() == 1 && spec[0] == "all") return known;
  if (spec.size() == 1 && spec[0] == "default")
    return {known.begin() + 2, known.end()};  // musubi-tuner excludes the modulations
  if (spec.size() == 1 && spec[0] == "attention") return {known.begin() + 2, known.begin() + 10};
  return RequireKnownTargets(spec, known, "\"default\", \"attention\", \"all\"",
                             "a Qwen-Image block", where);
}

bool IsQwenImageBlockLinearWeight(const std::string& name) {
  std::string rel;
  if (!SplitNumberedName(name, "transformer_blocks.", &rel)) return false;
  for (const std::string& linear : QwenImageBlockLinears())
    if (rel == linear + ".weight") return true;
  return false;
}

}  // namespace lorastream
