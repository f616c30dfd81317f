#include "common/flux_job.h"

#include <filesystem>
#include <sstream>

#include "common/error.h"
#include "common/flux_config.h"
#include "common/job_paths.h"
#include "common/job_spec.h"
#include "common/toml_file.h"

namespace lorastream {

FluxJob ParseFluxJob(const TomlSection& t) {
  t.RejectUnknownKeys({"checkpoint",
                       "store",
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
                       "gpu_memory_budget",
                       "init_from"});
  FluxJob j;
  if (t.Has("checkpoint") == t.Has("store"))
    throw Error(ErrorCode::kRefused, t.Where("checkpoint") +
                                         ": name exactly one of flux.checkpoint (a FLUX.1 "
                                         "checkpoint) and flux.store (a store serving one)");
  if (t.Has("checkpoint")) j.checkpoint = t.RequireString("checkpoint");
  if (t.Has("store")) j.store = t.RequireString("store");
  if (t.Has("store") && t.Has("singles_per_unit"))
    throw Error(ErrorCode::kRefused,
                t.Where("singles_per_unit") +
                    ": a store fixes its units when it is served; remove the key (the store's "
                    "manifest records its single blocks per unit)");
  j.cache_dir = t.RequireString("cache_dir");
  j.output_dir = t.RequireString("output_dir");
  j.steps = t.GetInt("steps", j.steps);
  j.batch_size = t.GetInt("batch_size", j.batch_size);
  const int64_t seed = t.GetInt("seed", 0);
  if (seed < 0) throw Error(ErrorCode::kCorrupt, t.Where("seed") + " must be >= 0");
  j.seed = static_cast<uint64_t>(seed);
  j.learning_rate = t.GetDouble("learning_rate", j.learning_rate);
  j.lr_schedule = t.GetString("lr_schedule", j.lr_schedule);
  j.warmup_steps = t.GetInt("warmup_steps", j.warmup_steps);
  j.weight_decay = t.GetDouble("weight_decay", j.weight_decay);
  j.max_grad_norm = t.GetDouble("max_grad_norm", j.max_grad_norm);
  // Starting from an adapter, what the job leaves out is the adapter's (0 / 0 / []: resolved
  // by the worker when it reads the file, worker/flux/flux_adapter_io.h ApplyFluxInitFrom).
  j.init_from = t.GetString("init_from", "");
  const bool from_adapter = !j.init_from.empty();
  j.rank = t.GetInt("rank", from_adapter ? 0 : j.rank);
  j.alpha = t.GetDouble("alpha", from_adapter ? 0.0 : static_cast<double>(j.rank));
  j.targets = t.GetStrings("targets", from_adapter ? std::vector<std::string>{} : j.targets);
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
  return j;
}

std::string FluxJobToToml(const FluxJob& j) {
  toml::array targets;
  for (const std::string& t : j.targets) targets.push_back(t);
  // Integers TOML cannot hold (above INT64_MAX) are written as they wrap: ParseFluxJob then
  // refuses them, as JobSpecToToml does.
  const auto integer = [](uint64_t v) { return static_cast<int64_t>(v); };
  toml::table flux{{"cache_dir", j.cache_dir},
                   {"output_dir", j.output_dir},
                   {"steps", j.steps},
                   {"batch_size", j.batch_size},
                   {"seed", integer(j.seed)},
                   {"learning_rate", j.learning_rate},
                   {"lr_schedule", j.lr_schedule},
                   {"warmup_steps", j.warmup_steps},
                   {"weight_decay", j.weight_decay},
                   {"max_grad_norm", j.max_grad_norm},
                   {"rank", j.rank},
                   {"alpha", j.alpha},
                   {"targets", std::move(targets)},
                   {"guidance", j.guidance},
                   {"timestep_sampling", j.timestep_sampling},
                   {"sigmoid_scale", j.sigmoid_scale},
                   {"discrete_flow_shift", j.discrete_flow_shift},
                   {"save_every", j.save_every},
                   {"keep_checkpoints", j.keep_checkpoints},
                   {"dtype", j.dtype},
                   {"blocks_to_swap", j.blocks_to_swap},
                   {"ring_size", j.ring_size},
                   {"init_from", j.init_from}};
  if (j.store.empty()) {
    flux.insert("checkpoint", j.checkpoint);
    flux.insert("singles_per_unit", j.singles_per_unit);
  } else {
    flux.insert("store", j.store);
  }
  if (j.budget_auto)
    flux.insert("gpu_memory_budget", "auto");
  else
    flux.insert("gpu_memory_budget", integer(j.gpu_memory_budget));
  std::ostringstream out;
  out << toml::table{{"flux", std::move(flux)}} << "\n";
  return out.str();
}

void ResolveFluxJob(FluxJob& j, const std::string& base_dir) {
  j.checkpoint = ResolveJobPath(j.checkpoint, base_dir);
  j.cache_dir = ResolveJobPath(j.cache_dir, base_dir);
  j.output_dir = ResolveJobPath(j.output_dir, base_dir);
  j.init_from = ResolveJobPath(j.init_from, base_dir);
}

std::vector<std::string> FluxJobProblems(const FluxJob& j, const std::string& source) {
  std::vector<std::string> p;
  auto refuse = [&](const std::string& key, const std::string& why) {
    p.push_back(source + ": key `flux." + key + "`: " + why);
  };
  if (j.checkpoint.empty() == j.store.empty())
    refuse("checkpoint", "name exactly one of flux.checkpoint and flux.store");
  if (!j.checkpoint.empty()) {
    try {
      DetectFluxCheckpoint(j.checkpoint);  // BFL's file or a diffusers folder, else why not
    } catch (const Error& e) {
      refuse("checkpoint", e.what());
    }
  }
  std::error_code ec;
  if (j.cache_dir.empty())
    refuse("cache_dir", "is required");
  else if (!std::filesystem::is_directory(j.cache_dir, ec))
    refuse("cache_dir", "names a folder that does not exist: " + j.cache_dir);
  if (j.output_dir.empty()) refuse("output_dir", "is required");
  if (j.steps < 1) refuse("steps", "must be at least 1");
  if (j.steps > kMaxTrainSteps)
    refuse("steps", "is above the limit of " + std::to_string(kMaxTrainSteps));
  if (j.batch_size < 1) refuse("batch_size", "must be at least 1");
  const bool from_adapter = !j.init_from.empty();
  if (from_adapter && !std::filesystem::exists(j.init_from, ec))
    refuse("init_from", "names no kohya LoRA file (or folder holding adapter_kohya.safetensors): " +
                            j.init_from);
  if (j.rank < 1 && !(from_adapter && j.rank == 0)) refuse("rank", "must be at least 1");
  if (j.rank > kMaxLoraRank)
    refuse("rank", "is above the limit of " + std::to_string(kMaxLoraRank));
  // 0 leaves the adapter as it is (with init_from: re-saved bit for bit).
  if (!(j.learning_rate >= 0)) refuse("learning_rate", "must be 0 or more");
  if (j.lr_schedule != "constant" && j.lr_schedule != "linear" && j.lr_schedule != "cosine")
    refuse("lr_schedule", "`" + j.lr_schedule + "`: constant, linear or cosine");
  if (j.timestep_sampling != "uniform" && j.timestep_sampling != "sigmoid" &&
      j.timestep_sampling != "shift" && j.timestep_sampling != "flux_shift")
    refuse("timestep_sampling",
           "`" + j.timestep_sampling + "`: uniform, sigmoid, shift or flux_shift");
  if (!(j.discrete_flow_shift > 0)) refuse("discrete_flow_shift", "must be positive");
  if (j.dtype != "f32" && j.dtype != "bf16") refuse("dtype", "`" + j.dtype + "`: f32 or bf16");
  if (j.blocks_to_swap < 0) refuse("blocks_to_swap", "must be 0 or more");
  if (j.ring_size < 1 || j.ring_size > kMaxRingSize)
    refuse("ring_size", "must be between 1 and " + std::to_string(kMaxRingSize));
  if (j.singles_per_unit < 1) refuse("singles_per_unit", "must be at least 1");
  if (j.save_every < 0) refuse("save_every", "must be 0 or more");
  if (j.keep_checkpoints < 1 || j.keep_checkpoints > kMaxKeepCheckpoints)
    refuse("keep_checkpoints", "must be between 1 and " + std::to_string(kMaxKeepCheckpoints));
  return p;
}

bool IsFluxJobFile(const std::string& path) {
  try {
    return TomlSection::Load(path).Has("flux");
  } catch (const Error&) {
    return false;  // missing or malformed: the LLM job loader names the problem as it always has
  }
}

FluxJob LoadFluxJob(const std::string& path) {
  const JobSpec spec = LoadJobSpec(path);
  if (!spec.is_flux)
    throw Error(ErrorCode::kRefused, path + ": not a FLUX job (it has no [flux] section)");
  return spec.flux;
}

}  // namespace lorastream
