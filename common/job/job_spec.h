// A training job as a human writes it: a TOML file (example: configs/jobs/tiny_llama.toml).
// Torch-free, so that the coordinator validates `submit` with the same code the worker runs.
//
// Every field, with its default (a field without a default is required):
//
// clang-format off
//   name = "job"                  # free text; shows in `lorastream jobs` and the logs
//   priority = 0                  # higher runs first (the coordinator's queue order)
//
//   [model]                       # exactly one of store / checkpoint
//   store = ""                    # name of a store published by `lorastream-store serve`
//   checkpoint = ""               # or a Hugging Face checkpoint folder (config.json +
//                                 #   *.safetensors), read directly (mmapped)
//
//   [data]
//   path = (required)             # the training data
//   format = ""                   # "jsonl" | "tokens"; "" = from the extension
//                                 #   (.jsonl -> jsonl, .tok/.bin -> tokens); common/formats/data.h
//   seq_len = 512                 # tokens per sequence
//   packing = true                # true: concatenate documents and cut seq_len chunks;
//                                 #   false: one document per sequence, truncated/padded
//   pad_id = 0                    # token id written into padding (never trained on)
//
//   [lora]
//   rank = 16                     # r, > 0
//   alpha = 32.0                  # lora_alpha; scale = alpha / rank (alpha / sqrt(rank)
//                                 #   with rslora)
//   dropout = 0.0                 # lora_dropout, in [0, 1)
//   targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
//   rslora = false                # use_rslora
//   init_from = ""                # a peft adapter folder to start from instead of peft's
//                                 #   init (not a resume: step 0, a fresh optimizer); its
//                                 #   rank, alpha, targets and rslora must equal the job's,
//                                 #   or are taken from it when rank/alpha/targets are left
//                                 #   out (the file then holds rank = 0, alpha = 0,
//                                 #   targets = [], which mean "the adapter's")
//
//   [optim]
//   type = "adamw"                # "adamw": f32 moments, torch.optim.AdamW's arithmetic;
//                                 #   "adamw8bit": 8-bit blockwise moments as bitsandbytes'
//                                 #   AdamW8bit (worker/train/adamw.h): 10 bytes per LoRA
//                                 #   parameter with its f32 weight and gradient, not 16
//   lr = 2e-4                     # peak learning rate
//   beta1 = 0.9
//   beta2 = 0.999
//   eps = 1e-8
//   weight_decay = 0.0            # decoupled (AdamW)
//   schedule = "constant"         # "constant" | "linear" | "cosine" (all with warmup,
//                                 #   as transformers' get_*_schedule_with_warmup)
//   warmup_steps = 0
//   grad_clip = 1.0               # max global grad norm; 0 = no clipping
//
//   [train]
//   steps = 0                     # optimizer steps; exactly one of steps / epochs
//   epochs = 0.0                  # or passes over the training data (> 0, may be
//                                 #   fractional): steps = ceil(epochs * sequences /
//                                 #   (batch_size * grad_accum)), sequences counted after
//                                 #   packing (and after the eval split); at least 1
//   batch_size = 1                # sequences per micro-batch
//   grad_accum = 1                # micro-batches per optimizer step
//   seed = 0                      # LoRA init, data order, dropout: CPU runs are bit-exact
//   checkpoint_every = 0          # steps between checkpoints (0 = only the final save)
//   output_dir = (required)       # adapter_model.safetensors, adapter_config.json,
//                                 #   checkpoint-N/, stats.jsonl
//   dtype = "auto"                # compute dtype: "auto" (bf16 on CUDA, f32 on CPU) |
//                                 #   "bf16" | "f32"; LoRA master weights are always f32
//   stats_file = ""               # per-step JSON lines; "" = OUTPUT_DIR/stats.jsonl
//   keep_checkpoints = 2          # newest complete checkpoint-N/ folders kept (>= 1; 2 so that
//                                 #   a damaged newest one has one to fall back on)
//   keep_best = false             # also keep the checkpoint with the lowest eval loss
//
//   [eval]                        # optional: an evaluation loss (no gradients)
//   path = ""                     # evaluation data, same formats as data.path, or
//   format = ""                   #   ("" = from the extension)
//   split = 0.0                   # a held-out fraction of the training documents, in
//                                 #   (0, 0.5]: chosen from train.seed, never trained on
//   every = 0                     # evaluate every N steps (0 = never between); always at
//                                 #   the end and at every checkpoint step, so that each
//                                 #   checkpoint records its eval loss (train.keep_best)
//   batches = 0                   # batches of train.batch_size sequences per evaluation,
//                                 #   always the same first ones (0 = the whole eval set)
//
//   [stream]                      # used by the streaming engine (worker/stream*)
//   blocks_to_swap = 0            # blocks streamed from host RAM (0 = all resident)
//   gpu_memory_budget = 0         # bytes (integer, or a string "8GiB"/"500MB"); when > 0
//                                 #   the engine plans the resident set from it instead
//   ring_size = 2                 # GPU slots for streamed blocks (>= 1)
//   forward_slots = 0             # slots during the forward pass: 0 = ring_size, -1 = as many
//                                 #   as fit within the plan's peak, N >= ring_size
//   backward_slots = 0            # the same for the backward pass (worker/stream/stream_plan.h)
//   taped_blocks = 0              # the last N blocks keep their activations into the
//                                 #   backward instead of being recomputed: 0 = none (with a
//                                 #   budget: the cost model's choice), -1 = as many as fit
// clang-format on
//
// A FLUX.1 job is a file with a [flux] section (common/job/flux_job.h), a Qwen-Image job one with
// a [qwen_image] section (common/job/qwen_image_job.h): the sections above hold their shared
// settings, [data] and [eval] are the LLM family's.
//
// Relative paths inside the file resolve against the file's own folder (common/job/job_paths.h;
// LoadJobSpec makes them absolute, so a spec travelling to a worker stays valid).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/model_config.h"
#include "common/job/flux_job.h"
#include "common/job/qwen_image_job.h"

namespace lorastream {

struct ModelSource {
  std::string store;       // a published store's name, or
  std::string checkpoint;  // a Hugging Face checkpoint folder
  template <class A>
  void serialize(A& ar) {
    ar(store, checkpoint);
  }
};

struct DataSpec {
  std::string path;
  std::string format;  // "jsonl" | "tokens" after LoadJobSpec (resolved from the extension)
  int64_t seq_len = 512;
  bool packing = true;
  int64_t pad_id = 0;
  template <class A>
  void serialize(A& ar) {
    ar(path, format, seq_len, packing, pad_id);
  }
};

struct LoraSpec {
  int64_t rank = 16;
  double alpha = 32.0;
  double dropout = 0.0;
  std::vector<std::string> targets = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                      "gate_proj", "up_proj", "down_proj"};
  bool rslora = false;
  std::string init_from;  // "" or a peft adapter folder (rank 0 / alpha 0 / no targets: its)
  template <class A>
  void serialize(A& ar) {
    ar(rank, alpha, dropout, targets, rslora, init_from);
  }
};

struct OptimSpec {
  std::string type = "adamw";  // "adamw" | "adamw8bit"
  double lr = 2e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  std::string schedule = "constant";
  int64_t warmup_steps = 0;
  double grad_clip = 1.0;
  template <class A>
  void serialize(A& ar) {
    ar(lr, beta1, beta2, eps, weight_decay, schedule, warmup_steps, grad_clip, type);
  }
};

struct TrainSpec {
  int64_t steps = 0;
  double epochs = 0.0;  // > 0: steps come from the data (ResolveStepsFromData)
  int64_t batch_size = 1;
  int64_t grad_accum = 1;
  uint64_t seed = 0;
  int64_t checkpoint_every = 0;
  std::string output_dir;
  std::string dtype = "auto";
  std::string stats_file;
  int64_t keep_checkpoints = 2;
  bool keep_best = false;
  template <class A>
  void serialize(A& ar) {
    ar(steps, batch_size, grad_accum, seed, checkpoint_every, output_dir, dtype, stats_file,
       keep_checkpoints, keep_best, epochs);
  }
};

// An evaluation set: a file of its own or a held-out split of the training data.
struct EvalSpec {
  std::string path;
  std::string format;  // like DataSpec::format
  double split = 0.0;
  int64_t every = 0;
  int64_t batches = 0;
  bool enabled() const { return !path.empty() || split > 0; }
  template <class A>
  void serialize(A& ar) {
    ar(path, format, split, every, batches);
  }
};

struct StreamSpec {
  int64_t blocks_to_swap = 0;
  uint64_t gpu_memory_budget = 0;  // bytes; 0 = plan from blocks_to_swap (unless budget_auto)
  // The budget is the memory free on the job's GPU when it starts (AutoMemoryBudget): a job
  // file's `gpu_memory_budget = "auto"`, and its default when its [stream] section names no
  // plan of its own (none of blocks_to_swap, ring_size, forward_slots, backward_slots,
  // taped_blocks, gpu_memory_budget). On the CPU it means no budget. Specs built in code
  // default to no budget.
  bool budget_auto = false;
  int64_t ring_size = 2;
  int64_t forward_slots = 0;   // 0: ring_size; -1: as many as fit within the plan's peak
  int64_t backward_slots = 0;  // 0: ring_size; -1: as many as fit within the plan's peak
  int64_t taped_blocks = 0;    // 0: none (a budget: the cost model's); -1: as many as fit
  template <class A>
  void serialize(A& ar) {
    ar(blocks_to_swap, gpu_memory_budget, budget_auto, ring_size, forward_slots, backward_slots,
       taped_blocks);
  }
};

struct JobSpec {
  std::string name = "job";
  int64_t priority = 0;
  ModelSource model;
  DataSpec data;
  LoraSpec lora;
  OptimSpec optim;
  TrainSpec train;
  StreamSpec stream;
  EvalSpec eval;
  std::string source;  // the file it came from (for messages); "" when built in code
  // A FLUX.1 job (a [flux] section): `flux` is then the whole job, kept as written (journals
  // serialize it), and the sections above mirror what every family shares (MirrorFluxJob):
  // the base, output folder, steps, checkpoints, seed, batch, dtype, optimizer and adapter
  // shape, where the one trainer, the scheduler and the listings read every job's. A file
  // may write those in the shared sections (common/job/flux_job.h: ParseFluxJobSections) or all
  // in [flux].
  bool is_flux = false;
  // A FLUX.1 job written in the [flux]-only form: where its keys now live, which loading the
  // file logs ("" otherwise; not kept).
  std::string flux_form_note;
  FluxJob flux;
  // A Qwen-Image job (a [qwen_image] section): its own keys; the shared sections above hold
  // the rest as written ([data] and [eval] unused).
  bool is_qwen_image = false;
  QwenImageJob qwen_image;
  template <class A>
  void serialize(A& ar) {
    ar(name, priority, model, data, lora, optim, train, stream, source, eval, is_flux, flux,
       is_qwen_image, qwen_image);
  }
};

// Limits on the sizes that reach an allocation (ValidateJobSpec refuses larger values, naming
// the key, the value and the limit). Far above any job that fits in a machine, far below a
// value that would end in std::bad_alloc or an overflow.
constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 20;     // batch_size * seq_len
constexpr int64_t kMaxLogitsPerMicroBatch = int64_t{1} << 36;  // tokens * vocab_size
constexpr int64_t kMaxGradAccum = int64_t{1} << 16;
constexpr int64_t kMaxTrainSteps = int64_t{1} << 30;
constexpr int64_t kMaxLoraRank = int64_t{1} << 16;  // and <= the model's hidden_size
constexpr int64_t kMaxKeepCheckpoints = 1000;
constexpr int64_t kMaxRingSize = 1024;
constexpr size_t kMaxJobNameBytes = 256;              // shown in listings, logs and every status
constexpr size_t kMaxJobFileBytes = size_t{1} << 20;  // a job file, as `submit` sends it

// The names accepted in [lora] targets.
const std::vector<std::string>& LoraTargetNames();

// Parses TOML text. Throws Error(kCorrupt) for TOML syntax, unknown keys and wrong value
// types (naming file and key). Does not check values: see ValidateJobSpec.
JobSpec ParseJobSpec(const std::string& toml_text, const std::string& source);

// The spec as a job file with every key written out (paths as they are, resolved or not;
// `source` is not part of it): ParseJobSpec(JobSpecToToml(s), s.source) gives `s` back. The
// coordinator's journal keeps jobs in this form, so a later build reads them as it reads a
// job file, a key it added taking its default.
std::string JobSpecToToml(const JobSpec& spec);

// The problem with the job's name ("" when none): longer than kMaxJobNameBytes, naming the
// limit. Part of ValidateJobSpec; `submit` asks before sending, as a name too long for a
// message would otherwise be refused as a protocol error.
std::string JobNameProblem(const JobSpec& spec);

// Every problem that stops the job from running, each naming the field, e.g.
// "job.toml: key `lora.rank` must be > 0 (found 0)". Empty when the job can run.
// `model` (optional) is the base model's architecture: when given (or when the spec names a
// checkpoint folder, whose config.json is read), seq_len, targets and the model's existence
// are checked against it too. Data contents (token ids against the vocabulary) are checked by
// the worker when it loads the data, naming the file and line.
std::vector<std::string> ValidateJobSpec(const JobSpec& spec, const ModelConfig* model = nullptr);

// Reads, parses, resolves (absolute paths, data format from the extension) and validates a
// job file; throws Error(kNotFound) for a missing file, kCorrupt for bad TOML, kRefused with
// every problem (one per line) when ValidateJobSpec finds any.
JobSpec LoadJobSpec(const std::string& path, const ModelConfig* model = nullptr);

// Makes the paths absolute against the current directory (job_paths.h: against a folder) and
// fills data.format from the extension when empty (exposed for specs built from text).
void ResolveJobSpec(JobSpec& spec);

// A FLUX job's (is_flux) base, output folder, steps, checkpoints, seed, batch, dtype, optimizer
// settings and adapter shape copied from its `flux` into the sections where every job's are
// read (the one trainer reads those).
void MirrorFluxJob(JobSpec& spec);

// Names the store `store` as the job's base (model.store, and a FLUX job's flux.store).
void SetJobStore(JobSpec& spec, const std::string& store);

// Throws Error(kRefused) listing the problems when there are any.
void RequireValidJobSpec(const JobSpec& spec, const ModelConfig* model = nullptr);

// Optimizer steps for `train.epochs` over `sequences` training sequences (see [train]).
int64_t StepsForEpochs(double epochs, int64_t sequences, int64_t batch_size, int64_t grad_accum);

// "8GiB", "500MB", "1024" -> bytes; throws Error(kCorrupt) naming `where` when malformed.
uint64_t ParseByteSize(const std::string& text, const std::string& where);

// A GPU memory budget key of `section`: an integer (bytes), a byte count with a unit, or
// "auto" (sets *is_auto). Error(kCorrupt) naming the key otherwise.
class TomlSection;
void ParseMemoryBudget(const TomlSection& section, const std::string& key, uint64_t* bytes,
                       bool* is_auto);

}  // namespace lorastream
