// A FLUX.1 LoRA job: a job file with a [flux] section (common/job/job_spec.h: a JobSpec with
// is_flux, which `submit` validates and the coordinator's journal keeps as it keeps every job).
// Torch-free. Relative paths resolve against the job file's folder. Written as one [flux]
// section, beside which the file holds only `name` and `priority`, every key with its default
// (the shared form moves most of them into every family's sections, under their names there:
// ParseFluxJobSections below):
//
// clang-format off
//   [flux]
//   checkpoint = "flux1-dev.safetensors"  # BFL's single file or a diffusers folder, or
//   store = "flux"               #   a store of one (lorastream-store serve): exactly one
//   cache_dir = (required)       # sd-scripts' latent and text-encoder caches
//                                #   (common/formats/flux_cache.h)
//   output_dir = (required)      # adapter_kohya.safetensors, pytorch_lora_weights.safetensors
//   steps = 100
//   batch_size = 1               # images of one bucket per step
//   seed = 0                     # adapter init, batch order, noise and timesteps of every step
//   learning_rate = 1e-4
//   lr_schedule = "constant"     # constant | linear | cosine (with warmup_steps)
//   warmup_steps = 0
//   weight_decay = 0.01          # AdamW
//   optimizer = "adamw"          # or "adamw8bit": 8-bit moments (common/job/job_spec.h)
//   max_grad_norm = 1.0          # 0: no clipping
//   rank = 16
//   alpha = 16.0                 # left out: the rank
//   targets = ["all"]            # ["attention"] or block-relative linear names
//   init_from = ""               # a kohya LoRA file (or a FLUX job's output_dir) to start
//                                #   from: not a resume (step 0, a fresh optimizer); its rank,
//                                #   alpha and targets must equal the job's, or are taken
//                                #   from it when left out (written out as 0, 0, [])
//   guidance = 1.0               # the guidance value FLUX.1-dev is trained with
//   timestep_sampling = "sigmoid"  # uniform | sigmoid | shift | flux_shift
//   sigmoid_scale = 1.0
//   discrete_flow_shift = 3.0    # for `shift`
//   save_every = 0               # also checkpoint every N steps (0: at the end and at a stop)
//   keep_checkpoints = 2         # output_dir/checkpoint-N folders kept (the newest)
//   dtype = "f32"                # compute dtype: f32 | bf16
//   gpu_memory_budget = 0        # bytes ("8GiB") or "auto": the planner chooses the units
//                                #   streamed and the ring (worker/flux/flux_plan.h); 0: none
//   blocks_to_swap = 0           # without a budget: units streamed through the ring
//   ring_size = 2
//   taped_blocks = 0             # the last N resident units keep their activations into the
//                                #   backward (no recompute): -1 = as many as fit; 0 = none
//                                #   (with a budget: the planner's choice), as stream.taped_blocks
//   singles_per_unit = 2         # single-stream blocks per streamed unit (a store's: fixed
//                                #   when it was served)
// clang-format on
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream {

class TomlSection;

struct FluxJob {
  std::string checkpoint, store, cache_dir, output_dir;
  int64_t steps = 100;
  int64_t batch_size = 1;
  uint64_t seed = 0;
  double learning_rate = 1e-4;
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;
  std::string optimizer = "adamw";  // "adamw" | "adamw8bit" (the shared form's optim.type)
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
  int64_t taped_blocks = 0;  // 0: none (a budget: the planner's); -1: as many as fit
  int64_t singles_per_unit = 2;
  std::string init_from;  // "" or a kohya file (rank 0 / alpha 0 / no targets: the file's)
  // Written in the shared form (ParseFluxJobSections): its messages name the keys there
  // (FluxKeyName), and FluxJobToToml writes it in that form. Sent with the job.
  bool shared_form = false;
  template <class A>
  void serialize(A& ar) {
    ar(checkpoint, store, cache_dir, output_dir, steps, batch_size, seed, learning_rate,
       lr_schedule, warmup_steps, weight_decay, max_grad_norm, rank, alpha, targets, guidance,
       timestep_sampling, sigmoid_scale, discrete_flow_shift, save_every, keep_checkpoints, dtype,
       gpu_memory_budget, budget_auto, blocks_to_swap, ring_size, singles_per_unit, init_from,
       taped_blocks, shared_form, optimizer);
  }
};

// The [flux] section `flux` as written (paths not resolved). Throws Error(kCorrupt) for an
// unknown key or a value of the wrong type, kRefused for a job naming both or neither of
// flux.checkpoint and flux.store, or a store with flux.singles_per_unit (a store's units are
// fixed when it is served); each names the file and the key.
FluxJob ParseFluxJob(const TomlSection& flux);
// The shared form of a FLUX.1 job: every family's sections ([model] store or checkpoint;
// [lora] rank, alpha, targets; [optim] lr, schedule, warmup_steps, weight_decay, grad_clip;
// [train] steps, batch_size, seed, output_dir, checkpoint_every, keep_checkpoints, dtype;
// [stream] gpu_memory_budget, blocks_to_swap, ring_size, taped_blocks) and a [flux] section holding
// only what is FLUX.1's own (cache_dir, guidance, timestep_sampling, sigmoid_scale,
// discrete_flow_shift, singles_per_unit). Keys absent take FluxJob's defaults. A moved key
// left in [flux], an LLM-only section ([data], [eval]) or key is refused naming it.
FluxJob ParseFluxJobSections(const TomlSection& doc);
// Whether a job file's document has any of the shared sections (the shared form).
bool HasSharedJobSections(const TomlSection& doc);
// The note for a job written in the [flux]-only form: where each of its moved keys now lives
// ("" when it has none).
std::string FluxLegacyNote(const TomlSection& flux);
// A key of `job` by its [flux]-only name ("store", "save_every") as the job's file writes it:
// "flux.store" in the [flux]-only form; in the shared form the key in its section
// ("model.store", "train.checkpoint_every"), FLUX.1's own keys staying in [flux]
// ("flux.cache_dir"). Every message about a FLUX.1 job's key names it so.
std::string FluxKeyName(const FluxJob& job, const std::string& flux_key);
// The job with every key written out, in its own form: "[flux]\n..." alone, or for a
// shared_form job the shared sections and [flux] with FLUX.1's own keys. Parsed back
// (ParseFluxJob, ParseFluxJobSections), it is the same job in the same form.
std::string FluxJobToToml(const FluxJob& job);
// Whether the job file text `toml_text` is a FLUX.1 job in the shared form (false for any
// other, or text that does not parse): what restores FluxJob::shared_form to a job whose
// journal spec was written in the [flux]-only form whatever the job's own form.
bool IsSharedFormFluxJobText(const std::string& toml_text);
// Makes the paths absolute against `base_dir` (common/job/job_paths.h).
void ResolveFluxJob(FluxJob& job, const std::string& base_dir);
// Every problem with the values, each naming `source` and the key as the job's file writes it
// ("job.toml: key `flux.rank`: must be at least 1"; `lora.rank` in the shared form). Empty
// when the job can run.
std::vector<std::string> FluxJobProblems(const FluxJob& job, const std::string& source);

// Whether the job file at `path` is a FLUX job (it has a [flux] section); false when it
// cannot be read or parsed.
bool IsFluxJobFile(const std::string& path);
// Loads, resolves and validates (LoadJobSpec); errors name the file and the key.
FluxJob LoadFluxJob(const std::string& path);

}  // namespace lorastream
