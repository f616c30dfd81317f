// A Qwen-Image LoRA job: a job file with a [qwen_image] section, which holds only what is
// Qwen-Image's own. Every other setting is in the sections every family shares
// (common/job/job_spec.h): [model] checkpoint (ComfyUI's single file or a diffusers folder),
// [lora] rank, alpha, targets, [optim], [train] steps, batch_size, seed, output_dir,
// checkpoint_every, keep_checkpoints, dtype, stats_file, and [stream] blocks_to_swap,
// ring_size. [data] and [eval] are the LLM family's and are refused. Torch-free. Every key of
// the section with its default:
//
// clang-format off
//   [qwen_image]
//   cache_dir = (required)        # musubi-tuner's caches (common/formats/qwen_image_cache.h)
//   timestep_sampling = "shift"   # uniform | sigmoid | shift | qwen_shift
//   sigmoid_scale = 1.0
//   discrete_flow_shift = 2.2     # for `shift` (musubi-tuner's example)
//   edit = false                  # true: a Qwen-Image-Edit LoRA, on musubi's _qie caches (each
//                                 # image's control latents in the sequence after its own)
// clang-format on
//
// [lora] targets default to ["default"] for a Qwen-Image job (musubi-tuner's: every block
// linear but the modulations); ["attention"], ["all"] or block-relative names
// ("attn.to_q") choose others (common/formats/qwen_image_config.h QwenImageTargets).
#pragma once

#include <string>
#include <vector>

namespace lorastream {

class TomlSection;

struct QwenImageJob {
  std::string cache_dir;
  std::string timestep_sampling = "shift";
  double sigmoid_scale = 1.0;
  double discrete_flow_shift = 2.2;
  bool edit = false;
  template <class A>
  void serialize(A& ar) {
    ar(cache_dir, timestep_sampling, sigmoid_scale, discrete_flow_shift, edit);
  }
};

// The [qwen_image] section; an unknown key or a value of the wrong type is Error(kCorrupt)
// naming the file and the key.
QwenImageJob ParseQwenImageSection(const TomlSection& section);
// Every problem with its values, each naming `source` and the key.
std::vector<std::string> QwenImageJobProblems(const QwenImageJob& job, const std::string& source);

}  // namespace lorastream
