#include "common/job/flux_job.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <sstream>
#include <utility>

#include "common/base/error.h"
#include "common/formats/flux_config.h"
#include "common/formats/toml_file.h"
#include "common/job/job_paths.h"
#include "common/job/job_spec.h"

namespace lorastream {

namespace {

// Where a job's FLUX.1 settings are read: by their [flux]-only names, each in its section
// under its name there (the [flux]-only form: every key in [flux]; the shared form: most in
// every family's sections, common/job/flux_job.h).
using KeyAt = std::function<std::pair<TomlSection, std::string>(const char* flux_key)>;

FluxJob ReadFluxJob(const KeyAt& at) {
  auto has = [&](const char* k) {
    const auto [section, key] = at(k);
    return section.Has(key);
  };
  auto where = [&](const char* k) {
    const auto [section, key] = at(k);
    return section.Where(key);
  };
  FluxJob j;
  auto path = [&](const char* k) {
    const auto [section, key] = at(k);
    return section.Path(key);
  };
  if (has("checkpoint") == has("store"))
    throw Error(ErrorCode::kRefused, where("checkpoint") + ": name exactly one of " +
                                         path("checkpoint") + " (a FLUX.1 checkpoint) and " +
                                         path("store") + " (a store serving one)");
  auto str = [&](const char* k, const std::string& fallback) {
    const auto [section, key] = at(k);
    return section.GetString(key, fallback);
  };
  auto integer = [&](const char* k, int64_t fallback) {
    const auto [section, key] = at(k);
    return section.GetInt(key, fallback);
  };
  auto real = [&](const char* k, double fallback) {
    const auto [section, key] = at(k);
    return section.GetDouble(key, fallback);
  };
  auto require = [&](const char* k) {
    const auto [section, key] = at(k);
    return section.RequireString(key);
  };
  if (has("checkpoint")) j.checkpoint = require("checkpoint");
  if (has("store")) j.store = require("store");
  if (has("store") && has("singles_per_unit"))
    throw Error(ErrorCode::kRefused,
                where("singles_per_unit") +
                    ": a store fixes its units when it is served; remove the key (the store's "
                    "manifest records its single blocks per unit)");
  j.cache_dir = require("cache_dir");
  j.output_dir = require("output_dir");
  j.steps = integer("steps", j.steps);
  j.batch_size = integer("batch_size", j.batch_size);
  const int64_t seed = integer("seed", 0);
  if (seed < 0) throw Error(ErrorCode::kCorrupt, where("seed") + " must be >= 0");
  j.seed = static_cast<uint64_t>(seed);
  j.learning_rate = real("learning_rate", j.learning_rate);
  j.lr_schedule = str("lr_schedule", j.lr_schedule);
  j.warmup_steps = integer("warmup_steps", j.warmup_steps);
  j.weight_decay = real("weight_decay", j.weight_decay);
  j.max_grad_norm = real("max_grad_norm", j.max_grad_norm);
  j.optimizer = str("optimizer", j.optimizer);
  // Starting from an adapter, what the job leaves out is the adapter's (0 / 0 / []: resolved
  // by the worker when it reads the file, worker/flux/flux_adapter_io.h ApplyFluxInitFrom).
  j.init_from = str("init_from", "");
  const bool from_adapter = !j.init_from.empty();
  j.rank = integer("rank", from_adapter ? 0 : j.rank);
  j.alpha = real("alpha", from_adapter ? 0.0 : static_cast<double>(j.rank));
  {
    const auto [section, key] = at("targets");
    j.targets = section.GetStrings(key, from_adapter ? std::vector<std::string>{} : j.targets);
  }
  j.guidance = real("guidance", j.guidance);
  j.timestep_sampling = str("timestep_sampling", j.timestep_sampling);
  j.sigmoid_scale = real("sigmoid_scale", j.sigmoid_scale);
  j.discrete_flow_shift = real("discrete_flow_shift", j.discrete_flow_shift);
  j.save_every = integer("save_every", j.save_every);
  j.keep_checkpoints = integer("keep_checkpoints", j.keep_checkpoints);
  j.dtype = str("dtype", j.dtype);
  j.blocks_to_swap = integer("blocks_to_swap", j.blocks_to_swap);
  if (has("gpu_memory_budget")) {
    const auto [section, key] = at("gpu_memory_budget");
    ParseMemoryBudget(section, key, &j.gpu_memory_budget, &j.budget_auto);
  }
  j.ring_size = integer("ring_size", j.ring_size);
  j.taped_blocks = integer("taped_blocks", j.taped_blocks);
  j.singles_per_unit = integer("singles_per_unit", j.singles_per_unit);
  return j;
}

}  // namespace

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
                       "optimizer",
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
                       "taped_blocks",
                       "singles_per_unit",
                       "gpu_memory_budget",
                       "init_from"});
  return ReadFluxJob([&t](const char* k) { return std::make_pair(t, std::string(k)); });
}

namespace {

// Where each key of the [flux]-only form lives in the shared form (every family's sections).
struct MovedKey {
  const char* flux_key;  // in [flux] alone
  const char* section;   // in the shared form
  const char* key;
};
constexpr MovedKey kMovedKeys[] = {
    {"checkpoint", "model", "checkpoint"},
    {"store", "model", "store"},
    {"output_dir", "train", "output_dir"},
    {"steps", "train", "steps"},
    {"batch_size", "train", "batch_size"},
    {"seed", "train", "seed"},
    {"save_every", "train", "checkpoint_every"},
    {"keep_checkpoints", "train", "keep_checkpoints"},
    {"dtype", "train", "dtype"},
    {"learning_rate", "optim", "lr"},
    {"lr_schedule", "optim", "schedule"},
    {"warmup_steps", "optim", "warmup_steps"},
    {"weight_decay", "optim", "weight_decay"},
    {"max_grad_norm", "optim", "grad_clip"},
    {"optimizer", "optim", "type"},
    {"rank", "lora", "rank"},
    {"alpha", "lora", "alpha"},
    {"targets", "lora", "targets"},
    {"init_from", "lora", "init_from"},
    {"blocks_to_swap", "stream", "blocks_to_swap"},
    {"ring_size", "stream", "ring_size"},
    {"taped_blocks", "stream", "taped_blocks"},
    {"gpu_memory_budget", "stream", "gpu_memory_budget"},
};
// What only FLUX.1 has: the [flux] section of the shared form.
const std::vector<std::string> kFluxOwnKeys = {"cache_dir",           "guidance",
                                               "timestep_sampling",   "sigmoid_scale",
                                               "discrete_flow_shift", "singles_per_unit"};

}  // namespace

bool HasSharedJobSections(const TomlSection& doc) {
  for (const char* section : {"model", "lora", "optim", "train", "stream"})
    if (doc.Has(section)) return true;
  return false;
}

FluxJob ParseFluxJobSections(const TomlSection& doc) {
  for (const char* llm_only : {"data", "eval"})
    if (doc.Has(llm_only))
      throw Error(ErrorCode::kInvalidArgument,
                  doc.Where(llm_only) + ": a FLUX.1 job reads its images from flux.cache_dir; [" +
                      llm_only + "] is an LLM job's section");
  const TomlSection flux = doc.Section("flux");
  std::string shared;  // the shared sections the file has
  for (const char* section : {"model", "lora", "optim", "train", "stream"})
    if (doc.Has(section)) shared += std::string(shared.empty() ? "[" : ", [") + section + "]";
  for (const MovedKey& m : kMovedKeys)
    if (flux.Has(m.flux_key))
      throw Error(ErrorCode::kInvalidArgument,
                  flux.Where(m.flux_key) + ": a job with " + shared +
                      " writes every shared key in its section: this one is `" + m.section + "." +
                      m.key + "` ([flux] holds only what is FLUX.1's own)");
  flux.RejectUnknownKeys(kFluxOwnKeys);
  for (const char* name : {"model", "lora", "optim", "train", "stream"}) {
    std::vector<std::string> keys;
    for (const MovedKey& m : kMovedKeys)
      if (std::string(m.section) == name) keys.push_back(m.key);
    doc.Section(name).RejectUnknownKeys(keys);
  }
  FluxJob j = ReadFluxJob([&doc, &flux](const char* k) {
    for (const MovedKey& m : kMovedKeys)
      if (std::string(m.flux_key) == k)
        return std::make_pair(doc.Section(m.section), std::string(m.key));
    return std::make_pair(flux, std::string(k));
  });
  j.shared_form = true;
  return j;
}

std::string FluxKeyName(const FluxJob& job, const std::string& flux_key) {
  if (job.shared_form)
    for (const MovedKey& m : kMovedKeys)
      if (flux_key == m.flux_key) return std::string(m.section) + "." + m.key;
  return "flux." + flux_key;
}

std::string FluxLegacyNote(const TomlSection& flux) {
  std::string moved;
  for (const MovedKey& m : kMovedKeys)
    if (flux.Has(m.flux_key))
      moved +=
          std::string(moved.empty() ? "" : ", ") + m.flux_key + " -> " + m.section + "." + m.key;
  if (moved.empty()) return "";
  return flux.file() +
         ": written as one [flux] section, it trains as before; every family now shares "
         "[model], [lora], [optim], [train] and [stream], and [flux] keeps only what is FLUX.1's "
         "own (docs/FLUX.md): " +
         moved;
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
                   {"optimizer", j.optimizer},
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
                   {"taped_blocks", j.taped_blocks},
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
  toml::table doc;
  if (j.shared_form)  // each shared key in its section, [flux] keeping FLUX.1's own
    for (const MovedKey& m : kMovedKeys)
      if (const toml::node* value = flux.get(m.flux_key)) {
        if (!doc.contains(m.section)) doc.insert(m.section, toml::table{});
        doc[m.section].as_table()->insert(m.key, *value);
        flux.erase(m.flux_key);
      }
  doc.insert("flux", std::move(flux));
  std::ostringstream out;
  out << doc << "\n";
  return out.str();
}

void ResolveFluxJob(FluxJob& j, const std::string& base_dir) {
  j.checkpoint = ResolveJobPath(j.checkpoint, base_dir);
  j.cache_dir = ResolveJobPath(j.cache_dir, base_dir);
  j.output_dir = ResolveJobPath(j.output_dir, base_dir);
  j.init_from = ResolveJobPath(j.init_from, base_dir);
}

namespace {
std::string Num(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}
}  // namespace

std::vector<std::string> FluxJobProblems(const FluxJob& j, const std::string& source) {
  std::vector<std::string> p;
  auto refuse = [&](const std::string& key, const std::string& why) {
    p.push_back(source + ": key `" + FluxKeyName(j, key) + "`: " + why);
  };
  if (j.checkpoint.empty() == j.store.empty())
    refuse("checkpoint", "name exactly one of " + FluxKeyName(j, "checkpoint") + " and " +
                             FluxKeyName(j, "store"));
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
  // Every float key finite first: a NaN or an infinity passes `> 0`-style checks one way or
  // the other and surfaces steps later as a loss of NaN blamed on the learning rate.
  const std::pair<const char*, double> floats[] = {{"learning_rate", j.learning_rate},
                                                   {"weight_decay", j.weight_decay},
                                                   {"max_grad_norm", j.max_grad_norm},
                                                   {"alpha", j.alpha},
                                                   {"guidance", j.guidance},
                                                   {"sigmoid_scale", j.sigmoid_scale},
                                                   {"discrete_flow_shift", j.discrete_flow_shift}};
  for (const auto& [name, value] : floats)
    if (!std::isfinite(value)) refuse(name, "must be a finite number (found " + Num(value) + ")");
  // 0 leaves the adapter as it is (with init_from: re-saved bit for bit).
  if (!(j.learning_rate >= 0)) refuse("learning_rate", "must be 0 or more");
  if (!(j.weight_decay >= 0)) refuse("weight_decay", "must be 0 or more");
  if (!(j.max_grad_norm >= 0)) refuse("max_grad_norm", "must be 0 (no clipping) or more");
  if (!(j.alpha > 0) && !(from_adapter && j.alpha == 0))  // 0 with init_from: the file's
    refuse("alpha", "must be positive");
  if (!(j.sigmoid_scale > 0)) refuse("sigmoid_scale", "must be positive");
  if (j.warmup_steps < 0 || j.warmup_steps > j.steps)
    refuse("warmup_steps", "must be in [0, " + FluxKeyName(j, "steps") + " = " +
                               std::to_string(j.steps) + "] (found " +
                               std::to_string(j.warmup_steps) + ")");
  if (j.optimizer != "adamw" && j.optimizer != "adamw8bit")
    refuse("optimizer", "`" + j.optimizer + "`: adamw or adamw8bit");
  if (j.lr_schedule != "constant" && j.lr_schedule != "linear" && j.lr_schedule != "cosine")
    refuse("lr_schedule", "`" + j.lr_schedule + "`: constant, linear or cosine");
  if (j.timestep_sampling != "uniform" && j.timestep_sampling != "sigmoid" &&
      j.timestep_sampling != "shift" && j.timestep_sampling != "flux_shift")
    refuse("timestep_sampling",
           "`" + j.timestep_sampling + "`: uniform, sigmoid, shift or flux_shift");
  if (!(j.discrete_flow_shift > 0)) refuse("discrete_flow_shift", "must be positive");
  if (j.dtype != "f32" && j.dtype != "bf16") refuse("dtype", "`" + j.dtype + "`: f32 or bf16");
  if (j.blocks_to_swap < 0) refuse("blocks_to_swap", "must be 0 or more");
  if (j.taped_blocks < -1)
    refuse("taped_blocks",
           "must be 0 (none, or the budget planner's choice), -1 (as many as fit) or a count");
  if (j.ring_size < 1 || j.ring_size > kMaxRingSize)
    refuse("ring_size", "must be between 1 and " + std::to_string(kMaxRingSize));
  if (j.singles_per_unit < 1) refuse("singles_per_unit", "must be at least 1");
  if (j.save_every < 0) refuse("save_every", "must be 0 or more");
  if (j.keep_checkpoints < 1 || j.keep_checkpoints > kMaxKeepCheckpoints)
    refuse("keep_checkpoints", "must be between 1 and " + std::to_string(kMaxKeepCheckpoints));
  return p;
}

bool IsSharedFormFluxJobText(const std::string& toml_text) {
  try {
    const TomlSection doc = TomlSection::Parse(toml_text, "job");
    return doc.Has("flux") && HasSharedJobSections(doc);
  } catch (const std::exception&) {
    return false;
  }
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
