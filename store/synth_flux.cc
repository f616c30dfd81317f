#include "store/synth_flux.h"

#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "common/device.h"
#include "common/error.h"
#include "common/flux_cache.h"
#include "common/safetensors.h"
#include "common/toml_file.h"
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
    if (!std::getline(ss, part, ',') || part.find_first_not_of(" 0123456789") != std::string::npos)
      throw Error(ErrorCode::kCorrupt,
                  t.Where("axes_dim") + ": `" + axes + "` is not three comma-separated integers");
    c.axes_dim[i] = std::stoll(part);
  }
  c.Validate(path);
  *dtype = FluxSynthDType(t.GetString("dtype", "bf16"), t.Where("dtype"));
  return c;
}

SynthResult RunSynthFlux(const SynthOptions& options, const std::string& preset_path) {
  const auto start = std::chrono::steady_clock::now();
  if (options.layers != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "--layers: a FLUX preset sets depth (double blocks) and depth_single itself");
  DType dtype = DType::kBF16;
  const FluxConfig config = LoadFluxPreset(preset_path, &dtype);
  if (!options.dtype.empty()) dtype = FluxSynthDType(options.dtype, "--dtype");
  std::vector<TensorToWrite> tensors;
  uint64_t total = 0;
  for (const auto& [name, shape] : FluxAllShapes(config)) {
    tensors.push_back({name, dtype, shape, nullptr});
    total += TensorBytes(tensors.back());
  }
  std::filesystem::create_directories(options.out_dir);
  const size_t esize = DTypeSize(dtype);
  auto fill = [&](size_t index, uint64_t offset, uint8_t* out, size_t n) {
    const TensorToWrite& t = tensors[index];
    for (uint64_t i = 0; i < n / esize; ++i) {
      const float v = SynthValue(t.name, t.shape.size(), options.seed, offset / esize + i);
      if (dtype == DType::kF32) {
        std::memcpy(out + i * 4, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kBF16 ? FloatToBF16(v) : FloatToHalf(v);
        std::memcpy(out + i * 2, &h, 2);
      }
    }
  };
  auto metadata = FluxMetadata(config);
  metadata["format"] = "pt";
  WriteSafetensorsStreamed(options.out_dir + "/flux1.safetensors", tensors, fill, metadata, 64);
  SynthResult r;
  r.bytes = total;
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
  WriteFluxCacheFiles(dir, "cat", 32, 32, shape, options.seed + 1);
  WriteFluxCacheFiles(dir, "dog", 32, 32, shape, options.seed + 2);
  WriteFluxCacheFiles(dir, "wide", 48, 32, shape, options.seed + 3);
}

}  // namespace lorastream::store
