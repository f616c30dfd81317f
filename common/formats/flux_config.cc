#include "common/formats/flux_config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/block_names.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

void AddLinear(TensorShapes& out, const std::string& name, int64_t out_dim, int64_t in_dim) {
  out.push_back({name + ".weight", {out_dim, in_dim}});
  out.push_back({name + ".bias", {out_dim}});
}

bool IsFile(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// A config.json of _class_name FluxTransformer2DModel in `dir` or in dir/transformer.
bool HasFluxTransformerConfig(const std::string& dir) {
  for (const std::string& cfg : {dir + "/transformer/config.json", dir + "/config.json"}) {
    if (!IsFile(cfg)) continue;
    const auto j = nlohmann::json::parse(ReadRegularFile(cfg, kMaxTextFileBytes), nullptr, false);
    if (!j.is_discarded() && j.is_object() &&
        j.value("_class_name", "") == "FluxTransformer2DModel")
      return true;
  }
  return false;
}

}  // namespace

void FluxConfig::Validate(const std::string& source) const {
  auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::kCorrupt, source + ": " + why);
  };
  if (hidden_size <= 0 || num_heads <= 0 || hidden_size % num_heads != 0)
    fail("hidden size " + std::to_string(hidden_size) + " is not a multiple of " +
         std::to_string(num_heads) + " heads");
  if (head_dim() % 2 != 0) fail("head_dim " + std::to_string(head_dim()) + " is odd");
  if (axes_dim[0] + axes_dim[1] + axes_dim[2] != head_dim() || axes_dim[0] % 2 || axes_dim[1] % 2 ||
      axes_dim[2] % 2 || axes_dim[0] <= 0 || axes_dim[1] <= 0 || axes_dim[2] <= 0)
    fail("RoPE axes_dim " + std::to_string(axes_dim[0]) + "," + std::to_string(axes_dim[1]) + "," +
         std::to_string(axes_dim[2]) + " must be positive, even and sum to head_dim " +
         std::to_string(head_dim()));
  if (depth < 0 || depth_single < 0 || depth + depth_single == 0) fail("the model has no block");
  if (depth > kMaxFluxBlocks || depth_single > kMaxFluxBlocks)
    fail(std::to_string(depth) + " double and " + std::to_string(depth_single) +
         " single blocks: above the limit of " + std::to_string(kMaxFluxBlocks) + " of a kind");
  if (hidden_size > (int64_t{1} << 16) || mlp_hidden > (int64_t{1} << 18) ||
      in_channels > (int64_t{1} << 12) || vec_in_dim > (int64_t{1} << 16) ||
      context_in_dim > (int64_t{1} << 16))
    fail(
        "a dimension is above its limit (hidden 65536, mlp 262144, channels 4096, text and "
        "pooled widths 65536)");
  if (mlp_hidden <= 0 || in_channels <= 0 || vec_in_dim <= 0 || context_in_dim <= 0)
    fail("a dimension is not positive");
}

TensorShapes FluxDoubleBlockShapes(const FluxConfig& c) {
  const int64_t h = c.hidden_size;
  TensorShapes out;
  for (const char* s : {"img", "txt"}) {
    const std::string p = s;
    AddLinear(out, p + "_mod.lin", 6 * h, h);
    AddLinear(out, p + "_attn.qkv", 3 * h, h);
    out.push_back({p + "_attn.norm.query_norm.scale", {c.head_dim()}});
    out.push_back({p + "_attn.norm.key_norm.scale", {c.head_dim()}});
    AddLinear(out, p + "_attn.proj", h, h);
    AddLinear(out, p + "_mlp.0", c.mlp_hidden, h);
    AddLinear(out, p + "_mlp.2", h, c.mlp_hidden);
  }
  return out;
}

TensorShapes FluxSingleBlockShapes(const FluxConfig& c) {
  const int64_t h = c.hidden_size;
  TensorShapes out;
  AddLinear(out, "linear1", 3 * h + c.mlp_hidden, h);
  AddLinear(out, "linear2", h, h + c.mlp_hidden);
  out.push_back({"norm.query_norm.scale", {c.head_dim()}});
  out.push_back({"norm.key_norm.scale", {c.head_dim()}});
  AddLinear(out, "modulation.lin", 3 * h, h);
  return out;
}

TensorShapes FluxRestShapes(const FluxConfig& c) {
  const int64_t h = c.hidden_size;
  TensorShapes out;
  AddLinear(out, "img_in", h, c.in_channels);
  AddLinear(out, "time_in.in_layer", h, 256);
  AddLinear(out, "time_in.out_layer", h, h);
  AddLinear(out, "vector_in.in_layer", h, c.vec_in_dim);
  AddLinear(out, "vector_in.out_layer", h, h);
  if (c.guidance_embed) {
    AddLinear(out, "guidance_in.in_layer", h, 256);
    AddLinear(out, "guidance_in.out_layer", h, h);
  }
  AddLinear(out, "txt_in", h, c.context_in_dim);
  AddLinear(out, "final_layer.linear", c.in_channels, h);  // patch 2x2 x 16 channels
  AddLinear(out, "final_layer.adaLN_modulation.1", 2 * h, h);
  return out;
}

TensorShapes FluxAllShapes(const FluxConfig& c) {
  TensorShapes out = FluxRestShapes(c);
  for (int64_t i = 0; i < c.depth; ++i)
    for (auto& [n, s] : FluxDoubleBlockShapes(c))
      out.push_back({"double_blocks." + std::to_string(i) + "." + n, s});
  for (int64_t i = 0; i < c.depth_single; ++i)
    for (auto& [n, s] : FluxSingleBlockShapes(c))
      out.push_back({"single_blocks." + std::to_string(i) + "." + n, s});
  return out;
}

std::vector<FluxUnit> FluxUnits(const FluxConfig& c, int64_t singles_per_unit) {
  if (singles_per_unit < 1)
    throw Error(ErrorCode::kRefused, "flux.singles_per_unit must be at least 1 (found " +
                                         std::to_string(singles_per_unit) + ")");
  std::vector<FluxUnit> out;
  for (int64_t i = 0; i < c.depth; ++i) out.push_back({true, i, 1});
  for (int64_t i = 0; i < c.depth_single; i += singles_per_unit)
    out.push_back({false, i, std::min(singles_per_unit, c.depth_single - i)});
  return out;
}

TensorShapes FluxUnitShapes(const FluxConfig& c, const FluxUnit& unit) {
  TensorShapes out;
  for (int64_t i = unit.first; i < unit.first + unit.count; ++i) {
    const std::string prefix =
        (unit.is_double ? "double_blocks." : "single_blocks.") + std::to_string(i) + ".";
    for (auto& [n, s] : unit.is_double ? FluxDoubleBlockShapes(c) : FluxSingleBlockShapes(c))
      out.push_back({prefix + n, s});
  }
  return out;
}

std::map<std::string, std::string> FluxMetadata(const FluxConfig& c) {
  return {{"flux.axes_dim", std::to_string(c.axes_dim[0]) + "," + std::to_string(c.axes_dim[1]) +
                                "," + std::to_string(c.axes_dim[2])},
          {"flux.num_heads", std::to_string(c.num_heads)},
          {"flux.theta", std::to_string(c.theta)}};
}

FluxConfig FluxConfigFromHeader(const SafetensorsHeader& header, const std::string& source) {
  auto need = [&](const std::string& name, size_t rank) -> const std::vector<int64_t>& {
    const auto* s = HeaderShape(header, name);
    if (s == nullptr)
      throw Error(ErrorCode::kCorrupt,
                  source + ": no tensor `" + name + "` (not FLUX.1 in BFL's single-file naming)");
    if (s->size() != rank)
      throw Error(ErrorCode::kCorrupt, source + ": tensor `" + name + "` has shape " +
                                           ShapeString(*s) + ", expected rank " +
                                           std::to_string(rank));
    return *s;
  };
  FluxConfig c;
  const auto& img_in = need("img_in.weight", 2);
  c.hidden_size = img_in[0];
  c.in_channels = img_in[1];
  c.vec_in_dim = need("vector_in.in_layer.weight", 2)[1];
  c.context_in_dim = need("txt_in.weight", 2)[1];
  c.depth = CountNumberedBlocks(header, "double_blocks.", kMaxFluxBlocks, source);
  c.depth_single = CountNumberedBlocks(header, "single_blocks.", kMaxFluxBlocks, source);
  c.guidance_embed = HeaderShape(header, "guidance_in.in_layer.weight") != nullptr;
  const std::string norm = c.depth > 0 ? "double_blocks.0.img_attn.norm.query_norm.scale"
                                       : "single_blocks.0.norm.query_norm.scale";
  const int64_t head_dim = need(norm, 1)[0];
  if (head_dim <= 0 || c.hidden_size % head_dim != 0)
    throw Error(ErrorCode::kCorrupt, source + ": q norm of " + std::to_string(head_dim) +
                                         " does not divide the hidden size " +
                                         std::to_string(c.hidden_size));
  c.num_heads = c.hidden_size / head_dim;
  c.mlp_hidden = c.depth > 0 ? need("double_blocks.0.img_mlp.0.weight", 2)[0]
                             : need("single_blocks.0.linear1.weight", 2)[0] - 3 * c.hidden_size;
  const auto meta = header.metadata;
  if (auto it = meta.find("flux.axes_dim"); it != meta.end()) {
    c.axes_dim = ParseAxesDim(it->second, "flux.axes_dim", head_dim, source);
  } else if (head_dim != 128) {
    throw Error(ErrorCode::kCorrupt,
                source + ": head_dim " + std::to_string(head_dim) +
                    " is not FLUX.1's 128 and the file's metadata has no flux.axes_dim");
  }
  if (auto it = meta.find("flux.theta"); it != meta.end()) {
    char* end = nullptr;
    const double theta = std::strtod(it->second.c_str(), &end);
    if (it->second.empty() || end != it->second.c_str() + it->second.size() ||
        !std::isfinite(theta) || theta <= 1.0 || theta > 1e12)
      throw Error(ErrorCode::kCorrupt, source + ": metadata `flux.theta` `" + it->second +
                                           "` is not a number in (1, 1e12] (FLUX.1: 10000)");
    c.theta = theta;
  }
  c.Validate(source);

  // Every tensor present, none extra, each of its shape.
  TensorShapes have;
  for (const auto& t : header.tensors) have.push_back({t.name, t.shape});
  RequireExactTensors(have, FluxAllShapes(c), source, "FLUX.1's transformer");
  return c;
}

FluxCheckpointKind DetectFluxCheckpoint(const std::string& path) {
  if (IsFile(path)) {
    if (!EndsWith(path, ".safetensors"))
      throw Error(ErrorCode::kUnsupported,
                  path +
                      ": not a .safetensors file; FLUX.1 is read from BFL's single file "
                      "(flux1-dev.safetensors) or a diffusers folder");
    const auto file = SafetensorsFile::Open(path);
    if (file.Find("img_in.weight") != nullptr) return FluxCheckpointKind::kBflFile;
    std::string why = "its tensors are not in BFL's naming (no img_in.weight)";
    if (file.Find("x_embedder.weight") != nullptr)
      why = "it is a diffusers transformer file (x_embedder.weight); name its folder instead";
    else if (file.Find("model.diffusion_model.img_in.weight") != nullptr)
      why = "it is a ComfyUI checkpoint (model.diffusion_model.*), which is not read";
    throw Error(ErrorCode::kUnsupported, path + ": " + why);
  }
  if (IsDir(path)) {
    if (HasFluxTransformerConfig(path)) return FluxCheckpointKind::kDiffusersFolder;
    throw Error(ErrorCode::kUnsupported,
                path +
                    ": a folder without a FluxTransformer2DModel config.json (in it or in "
                    "transformer/); FLUX.1 is read from BFL's single file or a diffusers folder");
  }
  throw Error(ErrorCode::kNotFound, path + ": does not exist");
}

bool IsFluxCheckpointPath(const std::string& path) {
  return IsFile(path) || (IsDir(path) && HasFluxTransformerConfig(path));
}

std::vector<std::string> FluxDoubleLinears() {
  std::vector<std::string> out;
  for (const char* s : {"img", "txt"})
    for (const char* m : {"_mod.lin", "_attn.qkv", "_attn.proj", "_mlp.0", "_mlp.2"})
      out.push_back(std::string(s) + m);
  return out;
}

std::vector<std::string> FluxSingleLinears() { return {"linear1", "linear2", "modulation.lin"}; }

bool IsFluxBlockLinearWeight(const std::string& name) {
  // "<kind>_blocks.<index>.<linear>.weight", the linear one of its kind's.
  for (const bool is_double : {true, false}) {
    std::string rel;
    if (!SplitNumberedName(name, is_double ? "double_blocks." : "single_blocks.", &rel)) continue;
    for (const std::string& linear : is_double ? FluxDoubleLinears() : FluxSingleLinears())
      if (rel == linear + ".weight") return true;
    return false;
  }
  return false;
}

std::vector<std::string> FluxTargets(const std::vector<std::string>& spec,
                                     const std::string& where) {
  if (spec.size() == 1 && spec[0] == "all") {
    std::vector<std::string> out = FluxDoubleLinears();
    for (auto& s : FluxSingleLinears()) out.push_back(s);
    return out;
  }
  if (spec.size() == 1 && spec[0] == "attention")
    return {"img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj", "linear1", "linear2"};
  std::vector<std::string> known = FluxDoubleLinears();
  for (auto& s : FluxSingleLinears()) known.push_back(s);
  return RequireKnownTargets(spec, known, "\"all\", \"attention\"", "a FLUX block", where);
}

std::string KohyaModuleName(const std::string& module) {
  std::string out = "lora_unet_" + module;
  std::replace(out.begin(), out.end(), '.', '_');
  return out;
}

std::vector<DiffusersPart> DiffusersParts(const std::string& module, const FluxConfig& c) {
  const int64_t h = c.hidden_size;
  auto split = [](const std::string& m, const std::string& prefix, int64_t* index,
                  std::string* rest) {
    if (!StartsWith(m, prefix)) return false;
    const size_t dot = m.find('.', prefix.size());
    *index = std::stoll(m.substr(prefix.size(), dot - prefix.size()));
    *rest = m.substr(dot + 1);
    return true;
  };
  int64_t i = 0;
  std::string rest;
  if (split(module, "double_blocks.", &i, &rest)) {
    const std::string b = "transformer_blocks." + std::to_string(i) + ".";
    static const std::map<std::string, std::string> kOne = {
        {"img_mod.lin", "norm1.linear"},        {"txt_mod.lin", "norm1_context.linear"},
        {"img_attn.proj", "attn.to_out.0"},     {"txt_attn.proj", "attn.to_add_out"},
        {"img_mlp.0", "ff.net.0.proj"},         {"img_mlp.2", "ff.net.2"},
        {"txt_mlp.0", "ff_context.net.0.proj"}, {"txt_mlp.2", "ff_context.net.2"}};
    if (auto it = kOne.find(rest); it != kOne.end())
      return {{b + it->second, 0,
               it->first.find("mod") != std::string::npos     ? 6 * h
               : it->first.find("mlp.0") != std::string::npos ? c.mlp_hidden
                                                              : h}};
    if (rest == "img_attn.qkv")
      return {
          {b + "attn.to_q", 0, h}, {b + "attn.to_k", h, 2 * h}, {b + "attn.to_v", 2 * h, 3 * h}};
    if (rest == "txt_attn.qkv")
      return {{b + "attn.add_q_proj", 0, h},
              {b + "attn.add_k_proj", h, 2 * h},
              {b + "attn.add_v_proj", 2 * h, 3 * h}};
  } else if (split(module, "single_blocks.", &i, &rest)) {
    const std::string b = "single_transformer_blocks." + std::to_string(i) + ".";
    if (rest == "linear1")
      return {{b + "attn.to_q", 0, h},
              {b + "attn.to_k", h, 2 * h},
              {b + "attn.to_v", 2 * h, 3 * h},
              {b + "proj_mlp", 3 * h, 3 * h + c.mlp_hidden}};
    if (rest == "linear2") return {{b + "proj_out", 0, h}};
    if (rest == "modulation.lin") return {{b + "norm.linear", 0, 3 * h}};
  }
  throw Error(ErrorCode::kInternal, "no diffusers name for FLUX module `" + module + "`");
}

}  // namespace lorastream
