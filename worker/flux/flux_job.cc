#include "worker/flux/flux_job.h"

#include "common/error.h"
#include "common/job_paths.h"
#include "common/job_spec.h"
#include "common/toml_file.h"

namespace lorastream::worker::flux {

bool IsFluxJobFile(const std::string& path) {
  try {
    return TomlSection::Load(path).Has("flux");
  } catch (const Error&) {
    return false;  // missing or malformed: the LLM job loader names the problem as it always has
  }
}

FluxJob LoadFluxJob(const std::string& path) {
  const TomlSection root = TomlSection::Load(path);
  root.RejectUnknownKeys({"flux"});
  const TomlSection t = root.Section("flux");
  t.RejectUnknownKeys({"checkpoint",
                       "cache_dir",
                       "output_dir",
                       "steps",
                       "batch_size",
                       "seed",
                       "learning_rate",
                       "lr_schedule",
                       "warmup_steps",
                       "weight_decay",
                       "max_grad_norm",
                       "rank",
                       "alpha",
                       "targets",
                       "guidance",
                       "timestep_sampling",
                       "sigmoid_scale",
                       "discrete_flow_shift",
                       "save_every",
                       "keep_checkpoints",
                       "dtype",
                       "blocks_to_swap",
                       "ring_size",
                       "singles_per_unit",
                       "gpu_memory_budget"});
  const std::string base = JobFileDir(path);
  FluxJob j;
  j.checkpoint = ResolveJobPath(t.RequireString("checkpoint"), base);
  j.cache_dir = ResolveJobPath(t.RequireString("cache_dir"), base);
  j.output_dir = ResolveJobPath(t.RequireString("output_dir"), base);
  j.steps = t.GetInt("steps", j.steps);
  j.batch_size = t.GetInt("batch_size", j.batch_size);
  j.seed = static_cast<uint64_t>(t.GetInt("seed", 0));
  j.learning_rate = t.GetDouble("learning_rate", j.learning_rate);
  j.lr_schedule = t.GetString("lr_schedule", j.lr_schedule);
  j.warmup_steps = t.GetInt("warmup_steps", j.warmup_steps);
  j.weight_decay = t.GetDouble("weight_decay", j.weight_decay);
  j.max_grad_norm = t.GetDouble("max_grad_norm", j.max_grad_norm);
  j.rank = t.GetInt("rank", j.rank);
  j.alpha = t.GetDouble("alpha", static_cast<double>(j.rank));
  j.targets = t.GetStrings("targets", j.targets);
  j.guidance = t.GetDouble("guidance", j.guidance);
  j.timestep_sampling = t.GetString("timestep_sampling", j.timestep_sampling);
  j.sigmoid_scale = t.GetDouble("sigmoid_scale", j.sigmoid_scale);
  j.discrete_flow_shift = t.GetDouble("discrete_flow_shift", j.discrete_flow_shift);
  j.save_every = t.GetInt("save_every", j.save_every);
  j.keep_checkpoints = t.GetInt("keep_checkpoints", j.keep_checkpoints);
  j.dtype = t.GetString("dtype", j.dtype);
  j.blocks_to_swap = t.GetInt("blocks_to_swap", j.blocks_to_swap);
  if (t.Has("gpu_memory_budget"))
    ParseMemoryBudget(t, "gpu_memory_budget", &j.gpu_memory_budget, &j.budget_auto);
  j.ring_size = t.GetInt("ring_size", j.ring_size);
  j.singles_per_unit = t.GetInt("singles_per_unit", j.singles_per_unit);

  auto refuse = [&](const std::string& key, const std::string& why) {
    throw Error(ErrorCode::kRefused, t.Where(key) + ": " + why);
  };
  if (j.steps < 1) refuse("steps", "must be at least 1");
  if (j.batch_size < 1) refuse("batch_size", "must be at least 1");
  if (j.rank < 1) refuse("rank", "must be at least 1");
  if (!(j.learning_rate > 0)) refuse("learning_rate", "must be positive");
  if (j.lr_schedule != "constant" && j.lr_schedule != "linear" && j.lr_schedule != "cosine")
    refuse("lr_schedule", "`" + j.lr_schedule + "`: constant, linear or cosine");
  if (j.timestep_sampling != "uniform" && j.timestep_sampling != "sigmoid" &&
      j.timestep_sampling != "shift" && j.timestep_sampling != "flux_shift")
    refuse("timestep_sampling",
           "`" + j.timestep_sampling + "`: uniform, sigmoid, shift or flux_shift");
  if (!(j.discrete_flow_shift > 0)) refuse("discrete_flow_shift", "must be positive");
  if (j.dtype != "f32" && j.dtype != "bf16") refuse("dtype", "`" + j.dtype + "`: f32 or bf16");
  if (j.blocks_to_swap < 0) refuse("blocks_to_swap", "must be 0 or more");
  if (j.ring_size < 1) refuse("ring_size", "must be at least 1");
  if (j.singles_per_unit < 1) refuse("singles_per_unit", "must be at least 1");
  if (j.save_every < 0) refuse("save_every", "must be 0 or more");
  if (j.keep_checkpoints < 1) refuse("keep_checkpoints", "must be at least 1");
  return j;
}

}  // namespace lorastream::worker::flux
