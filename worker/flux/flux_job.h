// A FLUX.1 LoRA job: the [flux] section of a job file (TOML). Relative paths resolve against
// the job file's folder. Every key with its default:
//
//   [flux]
//   checkpoint = "flux1-dev.safetensors"  # BFL's single file
//   cache_dir = "cache"          # sd-scripts' latent and text-encoder caches (common/flux_cache.h)
//   output_dir = "out"           # adapter_kohya.safetensors, pytorch_lora_weights.safetensors
//   steps = 100
//   batch_size = 1               # images of one bucket per step
//   seed = 0                     # adapter init, batch order, noise and timesteps of every step
//   learning_rate = 1e-4
//   lr_schedule = "constant"     # constant | linear | cosine (with warmup_steps)
//   warmup_steps = 0
//   weight_decay = 0.01          # AdamW
//   max_grad_norm = 1.0          # 0: no clipping
//   rank = 16
//   alpha = 16.0
//   targets = ["all"]            # ["attention"] or block-relative linear names
//   guidance = 1.0               # the guidance value FLUX.1-dev is trained with
//   timestep_sampling = "sigmoid"  # uniform | sigmoid | shift | flux_shift
//   sigmoid_scale = 1.0
//   discrete_flow_shift = 3.0    # for `shift`
//   save_every = 0               # also checkpoint every N steps (0: at the end and at a stop)
//   keep_checkpoints = 2         # output_dir/checkpoint-N folders kept (the newest)
//   dtype = "f32"                # compute dtype: f32 | bf16
//   gpu_memory_budget = 0        # bytes ("8GiB") or "auto": the planner chooses the units
//                                # streamed and the ring (worker/flux/flux_plan.h); 0: none
//   blocks_to_swap = 0           # without a budget: units streamed through the ring
//   ring_size = 2
//   singles_per_unit = 2         # single-stream blocks per streamed unit
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream::worker::flux {

struct FluxJob {
  std::string checkpoint, cache_dir, output_dir;
  int64_t steps = 100;
  int64_t batch_size = 1;
  uint64_t seed = 0;
  double learning_rate = 1e-4;
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;
  int64_t rank = 16;
  double alpha = 16.0;
  std::vector<std::string> targets{"all"};
  double guidance = 1.0;
  std::string timestep_sampling = "sigmoid";
  double sigmoid_scale = 1.0;
  double discrete_flow_shift = 3.0;
  int64_t save_every = 0;
  int64_t keep_checkpoints = 2;
  std::string dtype = "f32";
  uint64_t gpu_memory_budget = 0;  // bytes; 0: plan from blocks_to_swap (unless budget_auto)
  bool budget_auto = false;        // "auto": a share of the GPU's free memory (none on a CPU)
  int64_t blocks_to_swap = 0;
  int64_t ring_size = 2;
  int64_t singles_per_unit = 2;
};

// Whether the job file at `path` is a FLUX job (it has a [flux] section); false when it
// cannot be read or parsed.
bool IsFluxJobFile(const std::string& path);
// Loads and validates; errors name the file and the key.
FluxJob LoadFluxJob(const std::string& path);

}  // namespace lorastream::worker::flux
