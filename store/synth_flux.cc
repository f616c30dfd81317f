#include "store/synth_flux.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/formats/flux_cache.h"
#include "common/formats/flux_diffusers.h"
#include "common/formats/safetensors.h"
#include "common/formats/toml_file.h"
#include "store/convert.h"

namespace lorastream::store {

namespace {

DType FluxSynthDType(const std::string& s, const std::string& where) {
  if (const std::optional<DType> d = ParseShortDType(s)) return *d;
  throw Error(ErrorCode::kInvalidArgument, where + ": dtype `" + s + "` must be f32, f16 or bf16");
}

}  // namespace

std::string PresetPath(const std::string& name_or_path, const std::string& presets_dir) {
  const bool is_path =
      name_or_path.find('/') != std::string::npos ||
      (name_or_path.size() > 5 && name_or_path.compare(name_or_path.size() - 5, 5, ".toml") == 0);
  return is_path ? name_or_path : presets_dir + "/" + name_or_path + ".toml";
}

bool IsFluxPreset(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;  // LoadPreset names the missing file
  return TomlSection::Load(path).GetString("model_type", "") == "flux";
}

FluxConfig LoadFluxPreset(const std::string& path, DType* dtype) {
  const TomlSection t = TomlSection::Load(path);
  t.RejectUnknownKeys({"model_type", "hidden_size", "num_heads", "depth", "depth_single",
                       "mlp_hidden", "in_channels", "vec_in_dim", "context_in_dim", "axes_dim",
                       "theta", "guidance_embed", "dtype"});
  FluxConfig c;
  c.hidden_size = t.RequireInt("hidden_size");
  c.num_heads = t.RequireInt("num_heads");
  c.depth = t.RequireInt("depth");
  c.depth_single = t.RequireInt("depth_single");
  c.mlp_hidden = t.GetInt("mlp_hidden", 4 * c.hidden_size);
  c.in_channels = t.GetInt("in_channels", 64);
  c.vec_in_dim = t.GetInt("vec_in_dim", 768);
  c.context_in_dim = t.GetInt("context_in_dim", 4096);
  c.theta = t.GetDouble("theta", 10000.0);
  c.guidance_embed = t.GetBool("guidance_embed", true);
  const std::string axes = t.GetString("axes_dim", "16,56,56");
  std::stringstream ss(axes);
  std::string part;
  for (int i = 0; i < 3; ++i) {
    if (!std::getline(ss, part, ',') ||
        part.find_first_not_of(" 0123456789") != std::string::npos ||
        part.find_first_of("0123456789") == std::string::npos || part.size() > 9)
      throw Error(ErrorCode::kCorrupt,
                  t.Where("axes_dim") + ": `" + axes + "` is not three comma-separated integers");
    c.axes_dim[i] = std::stoll(part);
  }
  c.Validate(path);
  *dtype = FluxSynthDType(t.GetString("dtype", "bf16"), t.Where("dtype"));
  return c;
}

namespace {

// Generator threads of a synth run (0: one per hardware thread).
int SynthThreads(const SynthOptions& options) {
  return options.threads > 0 ? options.threads
                             : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// The diffusers folder OUT/transformer/: config.json and the tensors, each element the value
// of the BFL element it converts from (so both layouts of one seed hold the same weights), in
// shards of at most shard_bytes (with the index when there are several).
uint64_t WriteFluxDiffusers(const SynthOptions& options, const FluxConfig& config, DType dtype,
                            int* shard_count) {
  const std::string dir = options.out_dir + "/transformer";
  std::filesystem::create_directories(dir);
  const std::string config_json = FluxDiffusersConfigJson(config);
  std::ofstream(dir + "/config.json") << config_json;
  std::map<std::string, std::vector<FluxDiffusersPart>> parts;  // by diffusers name
  for (auto& p : FluxDiffusersParts(config)) parts[p.diffusers].push_back(p);
  std::vector<std::vector<TensorToWrite>> shards(1);
  uint64_t total = 0, in_shard = 0;
  for (const auto& [name, shape] : FluxDiffusersShapes(config)) {
    TensorToWrite t{name, dtype, shape, nullptr};
    const uint64_t bytes = TensorBytes(t);
    if (in_shard > 0 && in_shard + bytes > options.shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(t);
    in_shard += bytes;
    total += bytes;
  }
  const size_t esize = DTypeSize(dtype);
  const int threads = SynthThreads(options);
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[96];
    std::snprintf(name, sizeof(name), "diffusion_pytorch_model-%05zu-of-%05zu.safetensors", s + 1,
                  shards.size());
    const std::string file =
        shards.size() == 1 ? "diffusion_pytorch_model.safetensors" : std::string(name);
    const auto& tensors = shards[s];
    // A chunk of a diffusers tensor, run by run of rows of one part: each run is contiguous
    // in the BFL tensor it converts from too.
    auto fill = [&](size_t index, uint64_t offset, uint8_t* out, size_t n) {
      const TensorToWrite& t = tensors[index];
      uint64_t row_len = 1;
      for (size_t d = 1; d < t.shape.size(); ++d) row_len *= static_cast<uint64_t>(t.shape[d]);
      const uint64_t begin = offset / esize, end = begin + n / esize;
      for (const FluxDiffusersPart& p : parts.at(t.name)) {
        const uint64_t part_begin = static_cast<uint64_t>(p.diffusers_row) * row_len;
        const uint64_t part_end = part_begin + static_cast<uint64_t>(p.rows) * row_len;
        const uint64_t from = std::max(begin, part_begin), to = std::min(end, part_end);
        if (from >= to) continue;
        const uint64_t bfl_first = static_cast<uint64_t>(p.bfl_row) * row_len + (from - part_begin);
        SynthFill(p.bfl, t.shape.size(), options.seed, bfl_first, to - from, dtype,
                  out + (from - begin) * esize, threads);
      }
    };
    WriteSafetensorsStreamed(dir + "/" + file, tensors, fill, {{"format", "pt"}}, 64);
    for (const auto& t : tensors) weight_map[t.name] = file;
  }
  if (shards.size() > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total}}},
                                  {"weight_map", weight_map}};
    std::ofstream(dir + "/diffusion_pytorch_model.safetensors.index.json") << index.dump(2) << "\n";
  }
  *shard_count = static_cast<int>(shards.size());
  return total;
}

}  // namespace

uint64_t WriteSynthFile(const std::string& path, const TensorShapes& shapes,
                        const std::string& prefix, DType dtype, const SynthOptions& options,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<TensorToWrite> tensors;
  uint64_t total = 0;
  for (const auto& [name, shape] : shapes) {
    tensors.push_back({prefix + name, dtype, shape, nullptr});
    total += TensorBytes(tensors.back());
  }
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  const size_t esize = DTypeSize(dtype);
  const int threads = SynthThreads(options);
  // The values of a tensor are its canonical name's, whatever prefix the file gives it.
  auto fill = [&](size_t index, uint64_t offset, uint8_t* out, size_t n) {
    const TensorToWrite& t = tensors[index];
    SynthFill(shapes[index].first, t.shape.size(), options.seed, offset / esize, n / esize, dtype,
              out, threads);
  };
  WriteSafetensorsStreamed(path, tensors, fill, metadata, 64);
  return total;
}

SynthResult RunSynthFlux(const SynthOptions& options, const std::string& preset_path) {
  const auto start = std::chrono::steady_clock::now();
  if (options.layers != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "--layers: a FLUX preset sets depth (double blocks) and depth_single itself");
  if (options.flux_format != "bfl" && options.flux_format != "diffusers")
    throw Error(ErrorCode::kInvalidArgument,
                "--flux-format `" + options.flux_format + "`: bfl or diffusers");
  DType dtype = DType::kBF16;
  const FluxConfig config = LoadFluxPreset(preset_path, &dtype);
  if (!options.dtype.empty()) dtype = FluxSynthDType(options.dtype, "--dtype");
  SynthResult r;
  if (options.flux_format == "diffusers") {
    r.bytes = WriteFluxDiffusers(options, config, dtype, &r.shards);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return r;
  }
  auto metadata = FluxMetadata(config);
  metadata["format"] = "pt";
  r.bytes = WriteSynthFile(options.out_dir + "/" + kSynthFluxFile, FluxAllShapes(config), "", dtype,
                           options, metadata);
  r.shards = 1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

void WriteFluxDemoCaches(const SynthOptions& options, const std::string& dir) {
  const std::string path = PresetPath(
      options.preset, options.presets_dir.empty() ? DefaultPresetsDir() : options.presets_dir);
  if (!IsFluxPreset(path))
    throw Error(ErrorCode::kInvalidArgument, "--flux-caches: preset " + path + " is not FLUX");
  DType dtype;
  const FluxConfig c = LoadFluxPreset(path, &dtype);
  std::filesystem::create_directories(dir);
  FluxCacheShape shape;
  shape.channels = c.in_channels / 4;
  shape.context_dim = c.context_in_dim;
  shape.vec_dim = c.vec_in_dim;
  shape.txt_len = options.flux_text_tokens;
  if (shape.txt_len < 1)
    throw Error(ErrorCode::kInvalidArgument, "--flux-text-tokens must be at least 1");
  if (!options.flux_cache_pixels.empty()) {
    const auto [w, h] = CacheImagePixels(options.flux_cache_pixels);
    WriteFluxCacheFiles(dir, "image", w, h, shape, options.seed + 1);
    return;
  }
  WriteFluxCacheFiles(dir, "cat", 32, 32, shape, options.seed + 1);
  WriteFluxCacheFiles(dir, "dog", 32, 32, shape, options.seed + 2);
  WriteFluxCacheFiles(dir, "wide", 48, 32, shape, options.seed + 3);
}

std::pair<int64_t, int64_t> CacheImagePixels(const std::string& p) {
  const size_t x = p.find('x');
  int64_t w = 0, h = 0;
  try {
    if (x == std::string::npos) throw std::invalid_argument(p);
    w = std::stoll(p.substr(0, x));
    h = std::stoll(p.substr(x + 1));
  } catch (const std::exception&) {
    w = h = 0;
  }
  if (w <= 0 || h <= 0 || w % 16 != 0 || h % 16 != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "--flux-cache-size `" + p + "`: WIDTHxHEIGHT in pixels, multiples of 16");
  return {w, h};
}

}  // namespace lorastream::store
