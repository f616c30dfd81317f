#include "store/synth_qwen_image.h"

#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/formats/block_names.h"
#include "common/formats/qwen_image_cache.h"
#include "common/formats/toml_file.h"
#include "store/synth_flux.h"

namespace lorastream::store {

bool IsQwenImagePreset(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  return TomlSection::Load(path).GetString("model_type", "") == "qwen_image";
}

QwenImageConfig LoadQwenImagePreset(const std::string& path, DType* dtype) {
  const TomlSection t = TomlSection::Load(path);
  t.RejectUnknownKeys({"model_type", "num_layers", "num_heads", "head_dim", "axes_dim",
                       "joint_attention_dim", "out_channels", "dtype"});
  QwenImageConfig c;
  c.num_layers = t.RequireInt("num_layers");
  c.num_heads = t.RequireInt("num_heads");
  c.head_dim = t.RequireInt("head_dim");
  c.joint_attention_dim = t.GetInt("joint_attention_dim", 3584);
  c.out_channels = t.GetInt("out_channels", 16);
  c.in_channels = c.patch_size * c.patch_size * c.out_channels;
  c.axes_dim = ParseAxesDim(t.GetString("axes_dim", "16,56,56"), "axes_dim", c.head_dim,
                            t.Where("axes_dim"));
  c.Validate(path);
  const std::string d = t.GetString("dtype", "bf16");
  const std::optional<DType> parsed = ParseShortDType(d);
  if (!parsed)
    throw Error(ErrorCode::kInvalidArgument,
                t.Where("dtype") + ": dtype `" + d + "` must be f32, f16 or bf16");
  *dtype = *parsed;
  return c;
}

SynthResult RunSynthQwenImage(const SynthOptions& options, const std::string& preset_path) {
  const auto start = std::chrono::steady_clock::now();
  if (options.layers != 0)
    throw Error(ErrorCode::kInvalidArgument, "--layers: a Qwen-Image preset sets num_layers");
  const std::string& format = options.qwen_image_format;
  if (format != "comfyui" && format != "comfyui-prefixed" && format != "diffusers")
    throw Error(ErrorCode::kInvalidArgument,
                "--qwen-image-format `" + format + "`: comfyui, comfyui-prefixed or diffusers");
  DType dtype = DType::kBF16;
  const QwenImageConfig c = LoadQwenImagePreset(preset_path, &dtype);
  if (!options.dtype.empty()) {
    const std::optional<DType> d = ParseShortDType(options.dtype);
    if (!d)
      throw Error(ErrorCode::kInvalidArgument,
                  "--dtype `" + options.dtype + "` must be f32, f16 or bf16");
    dtype = *d;
  }
  SynthResult r;
  r.shards = 1;
  if (format == "diffusers") {
    const std::string dir = options.out_dir + "/transformer";
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/config.json") << QwenImageConfigJson(c);
    r.bytes = WriteSynthFile(dir + "/diffusion_pytorch_model.safetensors", QwenImageAllShapes(c),
                             "", dtype, options, {{"format", "pt"}});
  } else {
    auto metadata = QwenImageMetadata(c);
    metadata["format"] = "pt";
    r.bytes =
        WriteSynthFile(options.out_dir + "/" + kSynthQwenImageFile, QwenImageAllShapes(c),
                       format == "comfyui" ? "" : "diffusion_model.", dtype, options, metadata);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

void WriteQwenImageDemoCaches(const SynthOptions& options, const std::string& preset_path,
                              const std::string& dir) {
  DType dtype;
  const QwenImageConfig c = LoadQwenImagePreset(preset_path, &dtype);
  std::filesystem::create_directories(dir);
  if (!options.flux_cache_pixels.empty()) {  // one image of that size, its caption's tokens
    if (options.flux_text_tokens < 1)
      throw Error(ErrorCode::kInvalidArgument, "--flux-text-tokens must be at least 1");
    const auto [w, h] = CacheImagePixels(options.flux_cache_pixels);
    WriteQwenImageCacheFiles(dir, "image", w, h, options.flux_text_tokens, c.joint_attention_dim,
                             options.seed + 1);
    return;
  }
  WriteQwenImageCacheFiles(dir, "cat", 32, 32, 5, c.joint_attention_dim, options.seed + 1);
  WriteQwenImageCacheFiles(dir, "dog", 32, 32, 3, c.joint_attention_dim, options.seed + 2);
  WriteQwenImageCacheFiles(dir, "wide", 48, 32, 4, c.joint_attention_dim, options.seed + 3);
}

}  // namespace lorastream::store
