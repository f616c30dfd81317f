// lorastream-synth: write a Hugging Face checkpoint with deterministic random weights.
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>

#include "common/base/cli_main.h"
#include "common/base/error.h"
#include "common/base/log.h"
#include "store/synth.h"
#include "store/synth_flux.h"
#include "store/synth_qwen_image.h"

int main(int argc, char** argv) {
  using namespace lorastream;
  using namespace lorastream::store;
  CLI::App app{"lorastream-synth: a checkpoint of a preset's shapes with deterministic weights"};
  SynthOptions o;
  app.add_option("--preset", o.preset, "preset name in configs/models (or a .toml path)")
      ->required();
  app.add_option("--out", o.out_dir, "output folder")->required();
  app.add_option("--layers", o.layers, "override num_hidden_layers");
  app.add_option("--seed", o.seed, "weights seed");
  app.add_option("--dtype", o.dtype, "f32 | f16 | bf16 (default: the preset's)");
  app.add_option("--shard-bytes", o.shard_bytes, "start a new shard past this many bytes");
  app.add_option("--threads", o.threads, "generator threads (0: all cores)");
  app.add_option("--presets-dir", o.presets_dir, "where presets live");
  app.add_option("--prequantized", o.prequantized,
                 "write a pre-quantised checkpoint: fp8 (block-scaled e4m3, as the official FP8 "
                 "uploads) | bnb-nf4 (bitsandbytes 4-bit nf4, as the -bnb-4bit uploads)")
      ->check(CLI::IsMember({"fp8", "bnb-nf4"}));
  app.add_option("--tokenizer", o.tokenizer_dir,
                 "a Hugging Face tokenizer folder to copy in (vocab_size grows to fit it), or "
                 "the name of one bundled with lorastream: llama3");
  app.add_flag("--force", o.force,
               "write into an --out folder that is not empty, replacing its checkpoint files");
  app.add_option("--flux-format", o.flux_format,
                 "FLUX presets: bfl (flux1.safetensors, BFL's single file) | diffusers "
                 "(transformer/ with config.json and shards, as diffusers saves it)")
      ->capture_default_str();
  app.add_option("--qwen-image-format", o.qwen_image_format,
                 "Qwen-Image presets: comfyui (qwen_image.safetensors, ComfyUI's single file) | "
                 "comfyui-prefixed (its names under diffusion_model.) | diffusers (transformer/ "
                 "with config.json)")
      ->capture_default_str();
  std::string caches;
  app.add_option("--caches,--flux-caches", caches,
                 "FLUX and Qwen-Image presets: also write random caches (sd-scripts' for FLUX, "
                 "musubi-tuner's for Qwen-Image; three images, two buckets) of the preset's "
                 "widths into this folder, for a demo job");
  app.add_option("--flux-cache-size", o.flux_cache_pixels,
                 "with --caches (FLUX, Qwen-Image): one image of WIDTHxHEIGHT pixels (1024x1024: "
                 "4096 image tokens) instead of the demo's three");
  app.add_option("--flux-text-tokens", o.flux_text_tokens,
                 "with --caches and --flux-cache-size: text tokens per caption (FLUX.1-dev's T5: "
                 "512)")
      ->capture_default_str();
  return RunMain("lorastream-synth", app, argc, argv, [&] {
    InitLogging("synth");
    SynthResult r = RunSynth(o);
    if (!caches.empty()) {
      const std::string preset =
          PresetPath(o.preset, o.presets_dir.empty() ? DefaultPresetsDir() : o.presets_dir);
      if (IsQwenImagePreset(preset))
        WriteQwenImageDemoCaches(o, preset, caches);
      else
        WriteFluxDemoCaches(o, caches);
    }
    std::printf("wrote %s: %llu bytes in %d shard(s), %.2f s (%.2f GB/s)\n", o.out_dir.c_str(),
                static_cast<unsigned long long>(r.bytes), r.shards, r.seconds,
                r.bytes / r.seconds / 1e9);
    return 0;
  });
}
