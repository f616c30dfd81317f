// `lorastream up`: one command that starts a local cluster (store, one worker per GPU or two
// CPU workers, coordinator), submits the example jobs, shows the live view until they end,
// prints where each adapter is and shuts everything down (unless --keep).
#pragma once

#include <string>
#include <vector>

#include "common/job/job_kind.h"

namespace lorastream::cli {

struct UpOptions {
  std::string model_dir;             // "" = the jobs' base, else synthesize `preset`
  std::string preset = "tiny";       // configs/models/<preset>.toml
  bool preset_given = false;         // --preset was given (else the jobs' family picks it)
  std::vector<std::string> jobs;     // job files; empty = configs/jobs/*.toml
  std::string run_dir;               // "" = runs/up-<date>-<time> under the current folder
  std::vector<std::string> devices;  // empty = every visible GPU, else `cpu_workers` CPU workers
  int cpu_workers = 2;
  int jobs_per_worker = 0;      // `serve --jobs` of every worker (0: the worker's default)
  bool keep = false;            // leave the cluster running at the end
  bool detach = false;          // return once the jobs are submitted; `lorastream down` stops
  bool watch = true;            // show the live view
  std::string bin_dir;          // "" = the folder of the running `lorastream`
  std::string configs_dir;      // "" = ConfigsDir(): installed share/, else the source tree
  std::string tensorboard_dir;  // the coordinator writes TensorBoard runs here ("" = none)
};

// What `up` serves for its jobs, decided before anything starts.
struct UpModel {
  std::string model_dir;  // "" = synthesize `preset`
  std::string preset;
  ModelFamily family = ModelFamily::kLlm;  // of the store, and of every job
};

// The base `up` serves for `jobs`: --model when given; else the checkpoint the jobs name
// (model.checkpoint, or flux.checkpoint of a FLUX job written as one [flux] section; relative
// to the job file's folder); else --preset, or, when none was given, the tiny preset of the
// jobs' family ("tiny", "flux-tiny", "qwen-image-tiny"). Refused (Error kInvalidArgument,
// naming the job file) before anything starts: jobs of two families mixed (LLM, FLUX.1,
// Qwen-Image), two different checkpoints, or a job of another family than --model or --preset.
UpModel ChooseUpModel(const UpOptions& options, const std::vector<std::string>& jobs,
                      const std::string& configs_dir);

// runs/KIND-DATE-TIME under the current folder: where a command keeps what one run makes.
std::string DefaultRunDir(const std::string& kind);

// Returns the exit status: 0 when every job succeeded.
int RunUp(const UpOptions& options);

}  // namespace lorastream::cli
