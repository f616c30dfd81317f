#include "common/job/job_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/quant_format.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/tokenizer_id.h"
#include "common/formats/toml_file.h"
#include "common/job/job_paths.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace fs = std::filesystem;

const std::vector<std::string>& LoraTargetNames() {
  // A mixture of experts: "experts" names every expert's gate, up and down projections, and
  // mixtral's w1, w3, w2 are its gate_proj, up_proj, down_proj.
  static const std::vector<std::string> names = {"q_proj",    "k_proj",  "v_proj",    "o_proj",
                                                 "gate_proj", "up_proj", "down_proj", "experts",
                                                 "w1",        "w3",      "w2"};
  return names;
}

void ParseMemoryBudget(const TomlSection& section, const std::string& key, uint64_t* bytes,
                       bool* is_auto) {
  // An integer (bytes), a string with a unit, or "auto".
  try {
    const int64_t n = section.GetInt(key, 0);
    if (n < 0) throw Error(ErrorCode::kCorrupt, section.Where(key) + " must be >= 0");
    *bytes = static_cast<uint64_t>(n);
  } catch (const Error& e) {
    if (std::string(e.what()).find("must be an integer") == std::string::npos) throw;
    const std::string text = section.GetString(key, "");
    if (text == "auto")
      *is_auto = true;
    else if (!text.empty() && std::isalpha(static_cast<unsigned char>(text.front())))
      throw Error(ErrorCode::kCorrupt,
                  section.Where(key) +
                      " must be \"auto\" (the memory free on the GPU at job start) or a byte "
                      "count like 8GiB, 500MB or 1024 (found \"" +
                      text + "\")");
    else
      *bytes = ParseByteSize(text, section.Where(key));
  }
}

uint64_t ParseByteSize(const std::string& text, const std::string& where) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t digits_begin = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  std::string number = text.substr(digits_begin, i - digits_begin);
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit = text.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static const std::pair<const char*, double> kUnits[] = {{"", 1.0},
                                                          {"b", 1.0},
                                                          {"kb", 1e3},
                                                          {"mb", 1e6},
                                                          {"gb", 1e9},
                                                          {"tb", 1e12},
                                                          {"kib", 1024.0},
                                                          {"mib", 1048576.0},
                                                          {"gib", 1073741824.0},
                                                          {"tib", 1099511627776.0}};
  double mult = -1;
  for (const auto& [name, m] : kUnits)
    if (unit == name) mult = m;
  char* end = nullptr;
  double value = number.empty() ? -1 : std::strtod(number.c_str(), &end);
  if (mult < 0 || number.empty() || end != number.c_str() + number.size() || value < 0 ||
      !std::isfinite(value * mult) || value * mult > 1.8e19)
    throw Error(ErrorCode::kCorrupt, where +
                                         " must be a byte count like 8GiB, 500MB or 1024 "
                                         "(found \"" +
                                         text + "\")");
  return static_cast<uint64_t>(value * mult);
}

void MirrorFluxJob(JobSpec& s) {
  const FluxJob& f = s.flux;
  s.model.store = f.store;
  s.model.checkpoint = f.checkpoint;
  s.train.output_dir = f.output_dir;
  s.train.steps = f.steps;
  s.train.checkpoint_every = f.save_every;
  s.train.keep_checkpoints = f.keep_checkpoints;
  s.train.keep_best = false;
  s.train.seed = f.seed;
  s.train.batch_size = f.batch_size;
  s.train.grad_accum = 1;
  s.train.dtype = f.dtype;
  s.train.stats_file.clear();  // output_dir/stats.jsonl
  s.optim.lr = f.learning_rate;
  s.optim.schedule = f.lr_schedule;
  s.optim.warmup_steps = f.warmup_steps;
  s.optim.weight_decay = f.weight_decay;
  s.optim.grad_clip = f.max_grad_norm;
  s.optim.type = f.optimizer;
  s.lora.rank = f.rank;
  s.lora.alpha = f.alpha;
  s.lora.targets = f.targets;
}

void SetJobStore(JobSpec& s, const std::string& store) {
  s.model.store = store;
  if (s.is_flux) s.flux.store = store;
}

JobSpec ParseJobSpec(const std::string& toml_text, const std::string& source) {
  TomlSection doc = TomlSection::Parse(toml_text, source);
  JobSpec s;
  s.source = source;
  if (doc.Has("flux")) {
    s.is_flux = true;
    if (HasSharedJobSections(doc)) {  // every family's sections and FLUX.1's own [flux]
      s.flux = ParseFluxJobSections(doc);
      doc.RejectUnknownKeys(
          {"name", "priority", "model", "lora", "optim", "train", "stream", "flux"});
    } else {  // the [flux]-only form: every key in [flux]
      doc.RejectUnknownKeys({"name", "priority", "flux"});
      s.flux = ParseFluxJob(doc.Section("flux"));
      s.flux_form_note = FluxLegacyNote(doc.Section("flux"));
    }
    s.name = doc.GetString("name", s.name);
    s.priority = doc.GetInt("priority", s.priority);
    MirrorFluxJob(s);
    return s;
  }
  // A Qwen-Image job: the shared sections and its own; the LLM family's [data] and [eval]
  // are not among them.
  s.is_qwen_image = doc.Has("qwen_image");
  if (s.is_qwen_image)
    doc.RejectUnknownKeys(
        {"name", "priority", "model", "lora", "optim", "train", "stream", "qwen_image"});
  else
    doc.RejectUnknownKeys(
        {"name", "priority", "model", "data", "lora", "optim", "train", "stream", "eval"});
  s.name = doc.GetString("name", s.name);
  s.priority = doc.GetInt("priority", s.priority);

  TomlSection m = doc.Section("model");
  m.RejectUnknownKeys({"store", "checkpoint"});
  s.model.store = m.GetString("store", "");
  s.model.checkpoint = m.GetString("checkpoint", "");

  TomlSection d = doc.Section("data");
  d.RejectUnknownKeys({"path", "format", "seq_len", "packing", "pad_id"});
  s.data.path = d.GetString("path", "");
  s.data.format = d.GetString("format", "");
  s.data.seq_len = d.GetInt("seq_len", s.data.seq_len);
  s.data.packing = d.GetBool("packing", s.data.packing);
  s.data.pad_id = d.GetInt("pad_id", s.data.pad_id);

  TomlSection l = doc.Section("lora");
  l.RejectUnknownKeys({"rank", "alpha", "dropout", "targets", "rslora", "init_from"});
  s.lora.init_from = l.GetString("init_from", "");
  // Starting from an adapter, what the job leaves out is the adapter's (0 / 0 / []: resolved
  // by the worker when it reads the adapter, worker/model/lora.h ApplyInitFrom).
  const bool from_adapter = !s.lora.init_from.empty();
  s.lora.rank = l.GetInt("rank", from_adapter ? 0 : s.lora.rank);
  s.lora.alpha = l.GetDouble("alpha", from_adapter ? 0.0 : s.lora.alpha);
  s.lora.dropout = l.GetDouble("dropout", s.lora.dropout);
  if (s.is_qwen_image) s.lora.targets = {"default"};  // musubi-tuner's (QwenImageTargets)
  s.lora.targets =
      l.GetStrings("targets", from_adapter ? std::vector<std::string>{} : s.lora.targets);
  s.lora.rslora = l.GetBool("rslora", s.lora.rslora);

  TomlSection o = doc.Section("optim");
  o.RejectUnknownKeys({"type", "lr", "beta1", "beta2", "eps", "weight_decay", "schedule",
                       "warmup_steps", "grad_clip"});
  s.optim.type = o.GetString("type", s.optim.type);
  s.optim.lr = o.GetDouble("lr", s.optim.lr);
  s.optim.beta1 = o.GetDouble("beta1", s.optim.beta1);
  s.optim.beta2 = o.GetDouble("beta2", s.optim.beta2);
  s.optim.eps = o.GetDouble("eps", s.optim.eps);
  s.optim.weight_decay = o.GetDouble("weight_decay", s.optim.weight_decay);
  s.optim.schedule = o.GetString("schedule", s.optim.schedule);
  s.optim.warmup_steps = o.GetInt("warmup_steps", s.optim.warmup_steps);
  s.optim.grad_clip = o.GetDouble("grad_clip", s.optim.grad_clip);

  TomlSection t = doc.Section("train");
  t.RejectUnknownKeys({"steps", "epochs", "batch_size", "grad_accum", "seed", "checkpoint_every",
                       "output_dir", "dtype", "stats_file", "keep_checkpoints", "keep_best"});
  s.train.steps = t.GetInt("steps", 0);
  s.train.epochs = t.GetDouble("epochs", 0.0);
  s.train.batch_size = t.GetInt("batch_size", s.train.batch_size);
  s.train.grad_accum = t.GetInt("grad_accum", s.train.grad_accum);
  int64_t seed = t.GetInt("seed", 0);
  if (seed < 0)
    throw Error(ErrorCode::kCorrupt,
                t.Where("seed") + " must be >= 0 (found " + std::to_string(seed) + ")");
  s.train.seed = static_cast<uint64_t>(seed);
  s.train.checkpoint_every = t.GetInt("checkpoint_every", s.train.checkpoint_every);
  s.train.output_dir = t.GetString("output_dir", "");
  s.train.dtype = t.GetString("dtype", s.train.dtype);
  s.train.stats_file = t.GetString("stats_file", "");
  s.train.keep_checkpoints = t.GetInt("keep_checkpoints", s.train.keep_checkpoints);
  s.train.keep_best = t.GetBool("keep_best", s.train.keep_best);

  TomlSection e = doc.Section("eval");
  e.RejectUnknownKeys({"path", "format", "split", "every", "batches"});
  s.eval.path = e.GetString("path", "");
  s.eval.format = e.GetString("format", "");
  s.eval.split = e.GetDouble("split", 0.0);
  s.eval.every = e.GetInt("every", 0);
  s.eval.batches = e.GetInt("batches", 0);

  TomlSection st = doc.Section("stream");
  st.RejectUnknownKeys({"blocks_to_swap", "gpu_memory_budget", "ring_size", "forward_slots",
                        "backward_slots", "taped_blocks"});
  s.stream.blocks_to_swap = st.GetInt("blocks_to_swap", s.stream.blocks_to_swap);
  s.stream.ring_size = st.GetInt("ring_size", s.stream.ring_size);
  s.stream.forward_slots = st.GetInt("forward_slots", s.stream.forward_slots);
  s.stream.backward_slots = st.GetInt("backward_slots", s.stream.backward_slots);
  s.stream.taped_blocks = st.GetInt("taped_blocks", s.stream.taped_blocks);
  if (st.Has("gpu_memory_budget")) {
    ParseMemoryBudget(st, "gpu_memory_budget", &s.stream.gpu_memory_budget, &s.stream.budget_auto);
  } else {
    // No plan named: the planner chooses within the GPU's free memory.
    bool hand_plan = false;
    for (const char* k :
         {"blocks_to_swap", "ring_size", "forward_slots", "backward_slots", "taped_blocks"})
      hand_plan = hand_plan || st.Has(k);
    s.stream.budget_auto = !hand_plan;
  }
  if (s.is_qwen_image) s.qwen_image = ParseQwenImageSection(doc.Section("qwen_image"));
  return s;
}

std::string JobSpecToToml(const JobSpec& s) {
  if (s.is_flux) {
    std::ostringstream out;
    out << toml::table{{"name", s.name}, {"priority", s.priority}} << "\n\n"
        << FluxJobToToml(s.flux);
    return out.str();
  }
  const auto strings = [](const std::vector<std::string>& list) {
    toml::array a;
    for (const std::string& x : list) a.push_back(x);
    return a;
  };
  // Integers TOML cannot hold (above INT64_MAX) are written as they wrap: ParseJobSpec then
  // refuses them, and the coordinator refuses a spec that does not read back (Submit).
  const auto integer = [](uint64_t v) { return static_cast<int64_t>(v); };
  toml::table stream{{"blocks_to_swap", s.stream.blocks_to_swap},
                     {"ring_size", s.stream.ring_size},
                     {"forward_slots", s.stream.forward_slots},
                     {"backward_slots", s.stream.backward_slots},
                     {"taped_blocks", s.stream.taped_blocks}};
  if (s.stream.budget_auto)
    stream.insert("gpu_memory_budget", "auto");
  else
    stream.insert("gpu_memory_budget", integer(s.stream.gpu_memory_budget));
  toml::table doc{
      {"name", s.name},
      {"priority", s.priority},
      {"model", toml::table{{"store", s.model.store}, {"checkpoint", s.model.checkpoint}}},
      {"data", toml::table{{"path", s.data.path},
                           {"format", s.data.format},
                           {"seq_len", s.data.seq_len},
                           {"packing", s.data.packing},
                           {"pad_id", s.data.pad_id}}},
      {"lora", toml::table{{"rank", s.lora.rank},
                           {"alpha", s.lora.alpha},
                           {"dropout", s.lora.dropout},
                           {"targets", strings(s.lora.targets)},
                           {"rslora", s.lora.rslora},
                           {"init_from", s.lora.init_from}}},
      {"optim", toml::table{{"type", s.optim.type},
                            {"lr", s.optim.lr},
                            {"beta1", s.optim.beta1},
                            {"beta2", s.optim.beta2},
                            {"eps", s.optim.eps},
                            {"weight_decay", s.optim.weight_decay},
                            {"schedule", s.optim.schedule},
                            {"warmup_steps", s.optim.warmup_steps},
                            {"grad_clip", s.optim.grad_clip}}},
      {"train", toml::table{{"steps", s.train.steps},
                            {"epochs", s.train.epochs},
                            {"batch_size", s.train.batch_size},
                            {"grad_accum", s.train.grad_accum},
                            {"seed", integer(s.train.seed)},
                            {"checkpoint_every", s.train.checkpoint_every},
                            {"output_dir", s.train.output_dir},
                            {"dtype", s.train.dtype},
                            {"stats_file", s.train.stats_file},
                            {"keep_checkpoints", s.train.keep_checkpoints},
                            {"keep_best", s.train.keep_best}}},
      {"eval", toml::table{{"path", s.eval.path},
                           {"format", s.eval.format},
                           {"split", s.eval.split},
                           {"every", s.eval.every},
                           {"batches", s.eval.batches}}},
      {"stream", std::move(stream)}};
  if (s.is_qwen_image) {
    doc.erase("data");
    doc.erase("eval");
    const QwenImageJob& q = s.qwen_image;
    doc.insert("qwen_image", toml::table{{"cache_dir", q.cache_dir},
                                         {"timestep_sampling", q.timestep_sampling},
                                         {"sigmoid_scale", q.sigmoid_scale},
                                         {"discrete_flow_shift", q.discrete_flow_shift},
                                         {"edit", q.edit}});
  }
  std::ostringstream out;
  out << doc << "\n";
  return out.str();
}

std::string ResolveJobPath(const std::string& path, const std::string& base_dir) {
  if (path.empty()) return path;
  fs::path p(path);
  if (p.is_relative() && !base_dir.empty()) p = fs::path(base_dir) / p;
  return fs::absolute(p).lexically_normal().string();
}

std::string JobFileDir(const std::string& job_path) {
  return fs::absolute(fs::path(job_path)).parent_path().lexically_normal().string();
}

void ResolveJobSpec(JobSpec& s) { ResolveJobSpecIn(s, ""); }

void ResolveJobSpecIn(JobSpec& s, const std::string& base_dir) {
  if (s.is_flux) {
    ResolveFluxJob(s.flux, base_dir);
    MirrorFluxJob(s);
    return;
  }
  auto absolute = [&base_dir](std::string& p) { p = ResolveJobPath(p, base_dir); };
  absolute(s.model.checkpoint);
  absolute(s.data.path);
  absolute(s.train.output_dir);
  absolute(s.train.stats_file);
  absolute(s.eval.path);
  absolute(s.lora.init_from);
  absolute(s.qwen_image.cache_dir);
  auto format_from_extension = [](const std::string& path, std::string& format) {
    if (!format.empty()) return;
    std::string ext = fs::path(path).extension().string();
    if (ext == ".jsonl" || ext == ".json")
      format = "jsonl";
    else if (ext == ".tok" || ext == ".bin" || ext == ".tokens")
      format = "tokens";
  };
  format_from_extension(s.data.path, s.data.format);
  if (!s.eval.path.empty()) format_from_extension(s.eval.path, s.eval.format);
}

int64_t StepsForEpochs(double epochs, int64_t sequences, int64_t batch_size, int64_t grad_accum) {
  const double per_step = static_cast<double>(std::max<int64_t>(1, batch_size)) *
                          static_cast<double>(std::max<int64_t>(1, grad_accum));
  const double steps = std::ceil(epochs * static_cast<double>(sequences) / per_step);
  if (!(steps < 9.0e15))
    throw Error(ErrorCode::kRefused, "train.epochs = " + std::to_string(epochs) + " over " +
                                         std::to_string(sequences) +
                                         " sequences gives too many steps");
  return std::max<int64_t>(1, static_cast<int64_t>(steps));
}

std::string JobNameProblem(const JobSpec& s) {
  if (s.name.size() <= kMaxJobNameBytes) return "";
  return (s.source.empty() ? std::string("job") : s.source) + ": key `name` is " +
         std::to_string(s.name.size()) + " bytes long, above the limit of " +
         std::to_string(kMaxJobNameBytes) + " bytes";
}

namespace {

// What a Qwen-Image job's shared sections may not hold (the rest is checked as for every
// job), and its own section's problems.
std::vector<std::string> QwenImageSharedProblems(const JobSpec& s, const std::string& src) {
  std::vector<std::string> p;
  auto key = [&](const std::string& k) { return src + ": key `" + k + "` "; };
  if (!s.model.store.empty() && !s.model.checkpoint.empty())
    p.push_back(key("model") +
                "must name exactly one of `model.store` (a store serving Qwen-Image) or "
                "`model.checkpoint`");
  else if (s.model.store.empty() && s.model.checkpoint.empty())
    p.push_back(key("model.checkpoint") +
                "is required (ComfyUI's qwen_image_bf16.safetensors or a diffusers folder), or "
                "`model.store` naming a store serving one");
  else if (s.model.store.empty())
    try {
      DetectQwenImageCheckpoint(s.model.checkpoint);
    } catch (const Error& e) {
      p.push_back(key("model.checkpoint") + e.what());
    }
  std::error_code ec;
  const std::string& from = s.lora.init_from;
  if (!from.empty() && !fs::is_regular_file(from, ec) &&
      !fs::is_regular_file(fs::path(from) / "adapter_comfyui.safetensors", ec))
    p.push_back(key("lora.init_from") +
                "names neither a ComfyUI LoRA file nor a folder holding "
                "adapter_comfyui.safetensors: " +
                from);
  if (s.lora.dropout != 0.0) p.push_back(key("lora.dropout") + "must be 0 for a Qwen-Image job");
  if (s.lora.rslora) p.push_back(key("lora.rslora") + "must be false for a Qwen-Image job");
  try {
    if (from.empty() || !s.lora.targets.empty())  // none with init_from: the file's
      QwenImageTargets(s.lora.targets, key("lora.targets"));
  } catch (const Error& e) {
    p.push_back(e.what());
  }
  if (s.train.epochs != 0.0)
    p.push_back(key("train.epochs") + "is not read for a Qwen-Image job: give train.steps");
  if (s.train.grad_accum != 1)
    p.push_back(key("train.grad_accum") + "must be 1 for a Qwen-Image job (found " +
                std::to_string(s.train.grad_accum) + ")");
  if (s.train.keep_best)
    p.push_back(key("train.keep_best") +
                "needs an evaluation set, which a Qwen-Image job does not have");
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"stream.forward_slots", s.stream.forward_slots},
        {"stream.backward_slots", s.stream.backward_slots}})
    if (value != 0) p.push_back(key(name) + "must be 0 for a Qwen-Image job");
  for (std::string& why : QwenImageJobProblems(s.qwen_image, src)) p.push_back(std::move(why));
  return p;
}

std::string KeyOf(const std::string& src, const std::string& k) {
  return src + ": key `" + k + "` ";
}

std::string Num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

// The checks of a language-model job's own sections ([model], [data], lora.init_from's peft
// folder and the modules' names, the micro-batch's tokens, [eval]). `model` is the model's
// config when the caller has it; otherwise it is read from model.checkpoint into `loaded`,
// for the shared checks too.
std::vector<std::string> LanguageModelProblems(const JobSpec& s, const ModelConfig*& model,
                                               ModelConfig& loaded, const std::string& src) {
  std::vector<std::string> p;
  auto key = [&](const std::string& k) { return KeyOf(src, k); };
  auto num = Num;

  // [model]
  if (s.model.store.empty() == s.model.checkpoint.empty()) {
    p.push_back(key("model") +
                "must name exactly one of `model.store` (a published store) or "
                "`model.checkpoint` (a Hugging Face folder)");
  } else if (!s.model.checkpoint.empty() && model == nullptr) {
    fs::path cfg = fs::path(s.model.checkpoint) / "config.json";
    std::error_code ec;
    if (!fs::is_directory(s.model.checkpoint, ec)) {
      p.push_back(key("model.checkpoint") +
                  "names a folder that does not exist: " + s.model.checkpoint);
    } else {
      try {
        loaded = LoadModelConfig(cfg.string());
        model = &loaded;  // the caller's: the shared checks read it too
      } catch (const Error& e) {
        p.push_back(key("model.checkpoint") + "has no usable config.json: " + e.what());
      }
      // A pre-quantised checkpoint (fp8, bitsandbytes nf4) is read by a store, not by a worker
      // directly: say so here rather than refuse its first tensor's dtype later.
      if (model == &loaded && loaded.checkpoint_quant.compressed())
        p.push_back(key("model.checkpoint") + s.model.checkpoint + " is a pre-quantised (" +
                    QuantMethodName(loaded.checkpoint_quant.method) +
                    ") checkpoint, which a worker does not read itself: a store serves it "
                    "(`lorastream-store serve " +
                    s.model.checkpoint + " --name NAME`); name that store as `model.store`");
    }
  }

  // [data]
  std::error_code ec;
  if (s.data.path.empty()) {
    p.push_back(key("data.path") + "is required (a .jsonl or token file)");
  } else if (const std::string why = RegularFileProblem(s.data.path); !why.empty()) {
    p.push_back(key("data.path") + (why == "does not exist"
                                        ? "names a file that does not exist: " + s.data.path
                                        : s.data.path + " " + why));
  }
  if (s.data.format != "jsonl" && s.data.format != "tokens")
    p.push_back(key("data.format") + "must be \"jsonl\" or \"tokens\" (found \"" + s.data.format +
                "\"; it is taken from the extension .jsonl/.tok/.bin when absent)");
  if (s.data.seq_len < 2 || s.data.seq_len > (int64_t{1} << 22))
    p.push_back(key("data.seq_len") + "must be in [2, 4194304] (found " +
                std::to_string(s.data.seq_len) + ")");
  else if (model && s.data.seq_len > model->max_position_embeddings)
    p.push_back(key("data.seq_len") + "is " + std::to_string(s.data.seq_len) +
                ", longer than the model allows (max_position_embeddings = " +
                std::to_string(model->max_position_embeddings) + ")");
  else if (model && model->sliding_window > 0 && s.data.seq_len > model->sliding_window)
    p.push_back(key("data.seq_len") + "is " + std::to_string(s.data.seq_len) +
                ", longer than the model's attention window (sliding_window = " +
                std::to_string(model->sliding_window) +
                "); sliding-window attention is not implemented, so sequences must fit in it");
  // Data that `lorastream prepare` made for another tokenizer (a store's tokenizer is checked
  // where its manifest is read: `submit` on the store's host and the worker).
  if (!s.model.checkpoint.empty() && fs::is_regular_file(s.data.path, ec)) {
    const std::string why = DataTokenizerProblem(
        s.data.path, s.data.format, [&] { return ModelTokenizerId(s.model.checkpoint); },
        "model.checkpoint " + s.model.checkpoint, model ? model->vocab_size : 0);
    if (!why.empty()) p.push_back(key("data.path") + "is refused: " + why);
  }
  if (s.data.pad_id < 0 || (model && s.data.pad_id >= model->vocab_size))
    p.push_back(key("data.pad_id") + "must be a token id in [0, vocab_size) (found " +
                std::to_string(s.data.pad_id) + ")");

  // [lora]: a peft adapter folder to start from, the modules' names
  const bool from_adapter = !s.lora.init_from.empty();
  if (from_adapter && !fs::is_regular_file(fs::path(s.lora.init_from) / "adapter_config.json", ec))
    p.push_back(key("lora.init_from") + "names no peft adapter folder (adapter_config.json and " +
                "adapter_model.safetensors): " + s.lora.init_from);
  std::set<std::string> seen;
  for (const auto& t : s.lora.targets) {
    const auto& names = LoraTargetNames();
    if (std::find(names.begin(), names.end(), t) == names.end())
      p.push_back(key("lora.targets") + "names an unknown module `" + t +
                  "` (known: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; "
                  "for a mixture of experts also experts, w1, w3, w2)");
    else if (!seen.insert(t).second)
      p.push_back(key("lora.targets") + "names `" + t + "` twice");
  }

  // [train]: the micro-batch's tokens and their logits
  if (s.train.batch_size > 0 && s.train.batch_size <= kMaxMicroBatchTokens) {
    if (s.data.seq_len >= 2 && s.data.seq_len <= (int64_t{1} << 22) &&
        s.train.batch_size * s.data.seq_len > kMaxMicroBatchTokens)
      p.push_back(key("train.batch_size") + "times `data.seq_len` is " +
                  std::to_string(s.train.batch_size) + " x " + std::to_string(s.data.seq_len) +
                  " = " + std::to_string(s.train.batch_size * s.data.seq_len) +
                  " tokens per micro-batch, above the limit of " +
                  std::to_string(kMaxMicroBatchTokens) + " (lower one of them)");
    else if (model && model->vocab_size > 0 &&
             s.train.batch_size * s.data.seq_len > kMaxLogitsPerMicroBatch / model->vocab_size)
      p.push_back(key("train.batch_size") + "times `data.seq_len` is " +
                  std::to_string(s.train.batch_size * s.data.seq_len) +
                  " tokens per micro-batch: their logits over the model's vocabulary of " +
                  std::to_string(model->vocab_size) + " would exceed the limit of " +
                  std::to_string(kMaxLogitsPerMicroBatch) + " values (lower one of them)");
  }

  // [eval]
  if (!s.eval.path.empty() && s.eval.split != 0.0)
    p.push_back(key("eval.path") +
                "and `eval.split` are both given: evaluate on a file or on a "
                "held-out split of the training data, not both");
  if (!(s.eval.split >= 0 && s.eval.split <= 0.5))
    p.push_back(key("eval.split") +
                "must be in (0, 0.5] (a fraction of the training "
                "documents; found " +
                num(s.eval.split) + ")");
  if (!s.eval.path.empty()) {
    if (const std::string why = RegularFileProblem(s.eval.path); !why.empty())
      p.push_back(key("eval.path") + (why == "does not exist"
                                          ? "names a file that does not exist: " + s.eval.path
                                          : s.eval.path + " " + why));
    if (s.eval.format != "jsonl" && s.eval.format != "tokens")
      p.push_back(key("eval.format") + "must be \"jsonl\" or \"tokens\" (found \"" + s.eval.format +
                  "\"; it is taken from the extension .jsonl/.tok/.bin when "
                  "absent)");
  }
  if (s.eval.every < 0)
    p.push_back(key("eval.every") + "must be >= 0 (0 = only at checkpoints and the end; found " +
                std::to_string(s.eval.every) + ")");
  if (s.eval.batches < 0)
    p.push_back(key("eval.batches") + "must be >= 0 (0 = the whole eval set; found " +
                std::to_string(s.eval.batches) + ")");
  if (!s.eval.enabled() && (s.eval.every != 0 || s.eval.batches != 0))
    p.push_back(key("eval.every") + "needs an evaluation set: `eval.path` or `eval.split`");
  return p;
}

// The checks of the sections every job has ([lora], [optim], [train], [stream]), against the
// model's config where there is one.
std::vector<std::string> SharedSectionProblems(const JobSpec& s, const ModelConfig* model,
                                               const std::string& src) {
  std::vector<std::string> p;
  auto key = [&](const std::string& k) { return KeyOf(src, k); };
  auto num = Num;
  // Every size that reaches an allocation is bounded here, before any memory is taken:
  // `above` names the key, the value and the limit.
  auto above = [&](const std::string& k, int64_t value, int64_t limit) {
    p.push_back(key(k) + "is " + std::to_string(value) + ", above the limit of " +
                std::to_string(limit));
  };

  // [lora] (with init_from, rank 0 / alpha 0 / no targets mean "the adapter's")
  const bool from_adapter = !s.lora.init_from.empty();
  if (from_adapter && s.lora.rank == 0)
    ;  // the adapter's
  else if (s.lora.rank <= 0)
    p.push_back(key("lora.rank") + "must be > 0 (found " + std::to_string(s.lora.rank) + ")");
  else if (s.lora.rank > kMaxLoraRank)
    above("lora.rank", s.lora.rank, kMaxLoraRank);
  else if (model && model->hidden_size > 0 && s.lora.rank > model->hidden_size)
    p.push_back(key("lora.rank") + "is " + std::to_string(s.lora.rank) +
                ", above the model's hidden_size of " + std::to_string(model->hidden_size));
  if (!(s.lora.alpha > 0 || (from_adapter && s.lora.alpha == 0)) || !std::isfinite(s.lora.alpha))
    p.push_back(key("lora.alpha") + "must be > 0 (found " + num(s.lora.alpha) + ")");
  if (!(s.lora.dropout >= 0 && s.lora.dropout < 1))
    p.push_back(key("lora.dropout") + "must be in [0, 1) (found " + num(s.lora.dropout) + ")");
  if (s.lora.targets.empty() && !from_adapter)
    p.push_back(key("lora.targets") + "must name at least one module");

  // [optim]
  if (s.optim.type != "adamw" && s.optim.type != "adamw8bit")
    p.push_back(key("optim.type") + "must be \"adamw\" or \"adamw8bit\" (found \"" + s.optim.type +
                "\")");
  // lr = 0 leaves the adapter as it is (with lora.init_from: re-saved bit for bit).
  if (!(s.optim.lr >= 0) || !std::isfinite(s.optim.lr))
    p.push_back(key("optim.lr") + "must be >= 0 (found " + num(s.optim.lr) + ")");
  if (!(s.optim.beta1 >= 0 && s.optim.beta1 < 1))
    p.push_back(key("optim.beta1") + "must be in [0, 1) (found " + num(s.optim.beta1) + ")");
  if (!(s.optim.beta2 >= 0 && s.optim.beta2 < 1))
    p.push_back(key("optim.beta2") + "must be in [0, 1) (found " + num(s.optim.beta2) + ")");
  if (!(s.optim.eps > 0) || !std::isfinite(s.optim.eps))
    p.push_back(key("optim.eps") + "must be > 0 (found " + num(s.optim.eps) + ")");
  if (!(s.optim.weight_decay >= 0) || !std::isfinite(s.optim.weight_decay))
    p.push_back(key("optim.weight_decay") + "must be >= 0 (found " + num(s.optim.weight_decay) +
                ")");
  if (s.optim.schedule != "constant" && s.optim.schedule != "linear" &&
      s.optim.schedule != "cosine")
    p.push_back(key("optim.schedule") + "must be \"constant\", \"linear\" or \"cosine\" (found \"" +
                s.optim.schedule + "\")");
  if (s.optim.warmup_steps < 0 || s.optim.warmup_steps > kMaxTrainSteps ||
      (s.train.steps > 0 && s.optim.warmup_steps > s.train.steps))
    p.push_back(key("optim.warmup_steps") + "must be in [0, train.steps] (found " +
                std::to_string(s.optim.warmup_steps) + ")");
  if (!(s.optim.grad_clip >= 0) || !std::isfinite(s.optim.grad_clip))
    p.push_back(key("optim.grad_clip") + "must be >= 0 (0 = off; found " + num(s.optim.grad_clip) +
                ")");

  // [train]: exactly one of steps / epochs
  const bool by_epochs = s.train.epochs != 0.0;
  if (by_epochs && s.train.steps != 0)
    p.push_back(key("train.epochs") +
                "and `train.steps` are both given: keep exactly one "
                "(epochs computes the steps from the data)");
  else if (by_epochs && !(s.train.epochs > 0 && s.train.epochs <= 1e6))
    p.push_back(key("train.epochs") + "must be in (0, 1e6] (found " + num(s.train.epochs) + ")");
  else if (!by_epochs && s.train.steps == 0)
    p.push_back(key("train.steps") +
                "is required (the number of optimizer steps, > 0), or give `train.epochs` instead");
  else if (!by_epochs && s.train.steps < 0)
    p.push_back(key("train.steps") + "must be > 0 (found " + std::to_string(s.train.steps) + ")");
  else if (!by_epochs && s.train.steps > kMaxTrainSteps)
    above("train.steps", s.train.steps, kMaxTrainSteps);
  if (s.train.batch_size <= 0)
    p.push_back(key("train.batch_size") + "must be > 0 (found " +
                std::to_string(s.train.batch_size) + ")");
  else if (s.train.batch_size > kMaxMicroBatchTokens)
    above("train.batch_size", s.train.batch_size, kMaxMicroBatchTokens);
  if (s.train.grad_accum <= 0)
    p.push_back(key("train.grad_accum") + "must be > 0 (found " +
                std::to_string(s.train.grad_accum) + ")");
  else if (s.train.grad_accum > kMaxGradAccum)
    above("train.grad_accum", s.train.grad_accum, kMaxGradAccum);
  const double sequences = static_cast<double>(s.train.steps) *
                           static_cast<double>(s.train.batch_size) *
                           static_cast<double>(s.train.grad_accum);
  if (s.train.steps > 0 && s.train.batch_size > 0 && s.train.grad_accum > 0 &&
      sequences > static_cast<double>(int64_t{1} << 62))
    p.push_back(key("train.steps") + "times `train.batch_size` times `train.grad_accum` is " +
                num(sequences) + " sequences, above the limit of 2^62");
  if (s.train.keep_checkpoints < 1)
    p.push_back(key("train.keep_checkpoints") + "must be >= 1 (found " +
                std::to_string(s.train.keep_checkpoints) + ")");
  else if (s.train.keep_checkpoints > kMaxKeepCheckpoints)
    above("train.keep_checkpoints", s.train.keep_checkpoints, kMaxKeepCheckpoints);
  if (s.train.checkpoint_every < 0)
    p.push_back(key("train.checkpoint_every") + "must be >= 0 (0 = only at the end; found " +
                std::to_string(s.train.checkpoint_every) + ")");
  if (s.train.output_dir.empty())
    p.push_back(key("train.output_dir") + "is required (where the adapter is written)");
  if (!ParseComputeDType(s.train.dtype, Device{}))
    p.push_back(key("train.dtype") + "must be \"auto\", \"bf16\" or \"f32\" (found \"" +
                s.train.dtype + "\")");

  // [stream]
  if (s.stream.blocks_to_swap < 0 || (model && s.stream.blocks_to_swap > model->num_hidden_layers))
    p.push_back(key("stream.blocks_to_swap") + "must be in [0, num_hidden_layers" +
                (model ? " = " + std::to_string(model->num_hidden_layers) : std::string()) +
                "] (found " + std::to_string(s.stream.blocks_to_swap) + ")");
  if (s.stream.ring_size < 1)
    p.push_back(key("stream.ring_size") + "must be >= 1 (found " +
                std::to_string(s.stream.ring_size) + ")");
  else if (s.stream.ring_size > kMaxRingSize)
    above("stream.ring_size", s.stream.ring_size, kMaxRingSize);
  for (const auto& [name, slots] :
       {std::pair<const char*, int64_t>{"stream.forward_slots", s.stream.forward_slots},
        {"stream.backward_slots", s.stream.backward_slots}}) {
    if (slots < -1 || (slots > 0 && slots < s.stream.ring_size))
      p.push_back(key(name) +
                  "must be 0 (= ring_size), -1 (as many as fit) or >= ring_size (found " +
                  std::to_string(slots) + ")");
  }
  if (s.stream.taped_blocks < -1 || (model && s.stream.taped_blocks > model->num_hidden_layers))
    p.push_back(key("stream.taped_blocks") +
                "must be 0 (none, or the budget planner's choice), -1 (as many as fit) or a "
                "count up to num_hidden_layers" +
                (model ? " = " + std::to_string(model->num_hidden_layers) : std::string()) +
                " (found " + std::to_string(s.stream.taped_blocks) + ")");
  return p;
}

}  // namespace

std::vector<std::string> ValidateJobSpec(const JobSpec& s, const ModelConfig* model) {
  std::vector<std::string> p;
  auto add = [&p](std::vector<std::string> more) {
    for (std::string& why : more) p.push_back(std::move(why));
  };
  if (std::string why = JobNameProblem(s); !why.empty()) p.push_back(std::move(why));
  const std::string src = s.source.empty() ? std::string("job") : s.source;
  if (s.is_flux) {  // its own form (common/job/flux_job.h)
    add(FluxJobProblems(s.flux, src));
    return p;
  }
  // The family's own sections, then the shared ones.
  ModelConfig loaded;
  if (s.is_qwen_image)
    add(QwenImageSharedProblems(s, src));
  else
    add(LanguageModelProblems(s, model, loaded, src));
  add(SharedSectionProblems(s, model, src));
  return p;
}

void RequireValidJobSpec(const JobSpec& spec, const ModelConfig* model) {
  auto problems = ValidateJobSpec(spec, model);
  if (problems.empty()) return;
  std::string msg = "job refused:";
  for (const auto& pr : problems) msg += "\n  " + pr;
  throw Error(ErrorCode::kRefused, msg);
}

JobSpec LoadJobSpec(const std::string& path, const ModelConfig* model) {
  JobSpec spec = ParseJobSpec(ReadRegularFile(path, kMaxTomlBytes, "job file"), path);
  if (!spec.flux_form_note.empty()) LS_LOG_INFO("{}", spec.flux_form_note);
  ResolveJobSpecIn(spec, JobFileDir(path));
  RequireValidJobSpec(spec, model);
  return spec;
}

}  // namespace lorastream
