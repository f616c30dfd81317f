#include "worker/serve/merge.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "common/durable_file.h"
#include "common/error.h"
#include "common/flux_config.h"
#include "common/format_bytes.h"
#include "common/manifest.h"
#include "common/quant_format.h"
#include "common/remove_tree.h"
#include "common/safetensors.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_model.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/packed_weight.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

AdapterArg ParseAdapterArg(const std::string& arg) {
  AdapterArg a{arg, 1.0};
  const size_t colon = arg.rfind(':');
  if (colon == std::string::npos || colon + 1 == arg.size()) return a;
  const std::string tail = arg.substr(colon + 1);
  char* end = nullptr;
  const double w = std::strtod(tail.c_str(), &end);
  if (end == tail.c_str() || *end != '\0') return a;  // not a number: part of the path
  if (!std::isfinite(w))
    throw Error(ErrorCode::kInvalidArgument, "--adapter " + arg + ": the weight must be finite");
  a.path = arg.substr(0, colon);
  a.weight = w;
  return a;
}

namespace {

// One update to fold into a weight: delta = weight * scale * B A (f32, CPU).
struct Update {
  at::Tensor a, b;
  double factor = 1.0;  // the adapter's weight times its scale
};
// By the base tensor's full name.
using Updates = std::map<std::string, std::vector<Update>>;

c10::ScalarType OutType(const std::string& dtype) {
  if (dtype == "bf16") return at::kBFloat16;
  if (dtype == "f32") return at::kFloat;
  throw Error(ErrorCode::kInvalidArgument, "--dtype " + dtype + ": bf16 or f32");
}

bool IsFloating(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16 || d == DType::kF64;
}

// A base tensor as it is written: its name, stored dtype and shape, and how to read it (a
// floating tensor in its dtype; any other as the bytes to copy).
struct Source {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::function<at::Tensor()> load;
};

// The tensor `e` of the mapped `file`, as a view.
Source FileSource(const SafetensorsFile* file, const SafetensorsEntry* e) {
  return {e->name, e->dtype, e->shape, [file, e] {
            const auto type = IsFloating(e->dtype) ? ScalarTypeOf(e->dtype, e->name) : at::kByte;
            const std::vector<int64_t> shape =
                IsFloating(e->dtype) ? e->shape : std::vector<int64_t>{int64_t(e->nbytes())};
            return at::from_blob(const_cast<uint8_t*>(file->Data(*e)), shape,
                                 at::TensorOptions().dtype(type));
          }};
}

uint64_t OutputBytes(const Source& s, c10::ScalarType out) {
  uint64_t n = 1;
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n * DTypeSize(IsFloating(s.dtype) ? DTypeOf(out) : s.dtype);
}

// Tensor `s` of the output: merged with its updates (in f32) and cast when floating, its bytes
// as they are otherwise.
at::Tensor OutputTensor(const Source& s, const Updates& updates, c10::ScalarType out) {
  at::Tensor w = s.load();
  if (!IsFloating(s.dtype)) return w.contiguous();
  auto it = updates.find(s.name);
  if (it == updates.end()) return w.to(out).contiguous();
  at::Tensor merged = w.to(at::kFloat).clone();
  for (const Update& u : it->second) merged.add_(at::matmul(u.b, u.a), u.factor);
  return merged.to(out).contiguous();
}

// Progress on stderr: a line per tenth of the bytes written.
class Progress {
 public:
  Progress(bool on, uint64_t total, std::string what)
      : on_(on), total_(total), what_(std::move(what)) {}
  void Add(uint64_t bytes) {
    done_ += bytes;
    const int tenth = total_ ? static_cast<int>(done_ * 10 / total_) : 10;
    if (on_ && tenth > last_) {
      last_ = tenth;
      std::fprintf(stderr, "merge: %s %d%% (%s of %s)\n", what_.c_str(), tenth * 10,
                   FormatBytes(done_).c_str(), FormatBytes(total_).c_str());
    }
  }

 private:
  bool on_;
  uint64_t total_, done_ = 0;
  int last_ = 0;
  std::string what_;
};

// Writes `sources` into the safetensors file `path`, one tensor in memory at a time.
void WriteMerged(const std::string& path, const std::vector<Source>& sources,
                 const Updates& updates, c10::ScalarType out,
                 const std::map<std::string, std::string>& metadata, Progress& progress) {
  std::vector<TensorToWrite> entries;
  for (const Source& s : sources) {
    TensorToWrite t;
    t.name = s.name;
    t.dtype = IsFloating(s.dtype) ? DTypeOf(out) : s.dtype;
    t.shape = s.shape;
    entries.push_back(t);
  }
  size_t current = SIZE_MAX;
  at::Tensor tensor;
  c10::NoGradGuard no_grad;
  WriteSafetensorsStreamed(
      path, entries,
      [&](size_t index, uint64_t offset, uint8_t* dst, size_t n) {
        if (index != current) {
          current = index;
          tensor = OutputTensor(sources[index], updates, out);
        }
        std::memcpy(dst, static_cast<const uint8_t*>(tensor.data_ptr()) + offset, n);
        progress.Add(n);
      },
      metadata);
}

// Refuses an existing output without --force; the temporary name beside it.
std::string PrepareOutput(const MergeOptions& o) {
  if (o.out.empty()) throw Error(ErrorCode::kInvalidArgument, "merge: --out is required");
  std::error_code ec;
  if (fs::exists(o.out, ec) && !o.force)
    throw Error(ErrorCode::kRefused,
                o.out + " exists: merge does not overwrite it without --force");
  fs::path out = fs::absolute(o.out).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "DIR/"
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path(), ec);
  return (out.parent_path() /
          ("." + out.filename().string() + ".merging-" + std::to_string(::getpid())))
      .string();
}

// Moves `tmp` to `out`, replacing what is there (PrepareOutput refused it without --force).
void Publish(const std::string& tmp, const std::string& out) {
  std::error_code ec;
  if (fs::is_directory(out, ec)) {
    const std::string old = tmp + ".old";
    fs::rename(out, old, ec);
    if (ec) throw Error(ErrorCode::kIo, "cannot move " + out + " aside: " + ec.message());
    fs::rename(tmp, out, ec);
    if (ec)
      throw Error(ErrorCode::kIo, "cannot rename " + tmp + " to " + out + ": " + ec.message());
    std::string why;
    if (!RemoveTree(old, &why))
      std::fprintf(stderr, "merge: warning: could not remove the old output %s: %s\n", old.c_str(),
                   why.c_str());
  } else {
    fs::rename(tmp, out, ec);
    if (ec)
      throw Error(ErrorCode::kIo, "cannot rename " + tmp + " to " + out + ": " + ec.message());
  }
  FsyncPath(fs::absolute(out).parent_path().string());
}

std::string Describe(const std::vector<AdapterArg>& adapters) {
  std::string s;
  for (const AdapterArg& a : adapters) {
    std::ostringstream w;
    w << a.weight;
    s += (s.empty() ? "" : ", ") + a.path + " x" + w.str();
  }
  return s;
}

// ---- LLM: a Hugging Face folder ---------------------------------------------------------

// config.json with its dtype set to the output's (transformers 4: torch_dtype; 5: dtype).
std::string ConfigWithDtype(const std::string& path, const std::string& dtype) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw Error(ErrorCode::kCorrupt, path + ": not a JSON object");
  const std::string name = dtype == "bf16" ? "bfloat16" : "float32";
  j["torch_dtype"] = name;
  if (j.contains("dtype")) j["dtype"] = name;
  return j.dump(2) + "\n";
}

// The updates of peft adapters for a model of `config` whose tensors `has` names.
Updates LlmUpdates(const std::vector<AdapterArg>& args, const ModelConfig& config,
                   const std::function<bool(const std::string&)>& has, const std::string& base) {
  Updates updates;
  for (const AdapterArg& arg : args) {
    LoraAdapter a = LoraAdapter::Load(arg.path, config, at::kCPU);
    for (int i = 0; i < a.num_blocks(); ++i)
      for (const LoraSlot& slot : LoraSlots(config, a.settings(), a.block(i))) {
        const std::string name =
            "model.layers." + std::to_string(i) + "." + slot.module + ".weight";
        if (!has(name))
          throw Error(ErrorCode::kRefused,
                      arg.path + " adapts `" + name + "`, which " + base + " does not hold");
        updates[name].push_back(
            {slot.a->detach(), slot.b->detach(), arg.weight * a.settings().Scale()});
      }
  }
  return updates;
}

// A Hugging Face folder of `sources` with `updates` folded in: shards in the sources' order
// (each at most max_shard_bytes; a larger tensor alone), their index, `config_json`, and every
// other file of `beside` (a checkpoint folder: tokenizer, generation config, chat template)
// but its weights and config.
void WriteLlmFolder(const MergeOptions& o, const std::vector<AdapterArg>& args,
                    const std::vector<Source>& sources, const Updates& updates,
                    const std::string& config_json, const std::string& beside) {
  const c10::ScalarType out = OutType(o.dtype);
  const std::string tmp = PrepareOutput(o);
  fs::create_directories(tmp);
  try {
    std::vector<std::vector<Source>> shards(1);
    uint64_t shard_bytes = 0, total = 0;
    for (const Source& src : sources) {
      const uint64_t n = OutputBytes(src, out);
      if (shard_bytes > 0 && shard_bytes + n > o.max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().push_back(src);
      shard_bytes += n;
      total += n;
    }
    Progress progress(o.progress, total, "writing " + o.out);
    nlohmann::json weight_map = nlohmann::json::object();
    char name[64];
    for (size_t s = 0; s < shards.size(); ++s) {
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      WriteMerged((fs::path(tmp) / name).string(), shards[s], updates, out, {{"format", "pt"}},
                  progress);
      for (const Source& src : shards[s]) weight_map[src.name] = name;
    }
    nlohmann::json index{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    WriteFileDurably((fs::path(tmp) / "model.safetensors.index.json").string(),
                     index.dump(2) + "\n");
    WriteFileDurably((fs::path(tmp) / "config.json").string(), config_json);
    std::error_code ec;
    if (!beside.empty() && fs::is_directory(beside, ec))
      for (const auto& entry : fs::directory_iterator(beside)) {
        if (!entry.is_regular_file()) continue;
        const std::string file = entry.path().filename().string();
        const std::string ext = entry.path().extension().string();
        if (ext == ".safetensors" || ext == ".bin" || ext == ".pt" || ext == ".pth" ||
            file == "model.safetensors.index.json" || file == "config.json")
          continue;
        fs::copy_file(entry.path(), fs::path(tmp) / file, fs::copy_options::overwrite_existing);
      }
    FsyncFolder(tmp);
    Publish(tmp, o.out);
    std::printf("merged %s into %s: %s (%zu shard%s, %s, %zu weights changed) -> %s\n",
                Describe(args).c_str(), o.base.c_str(), o.dtype.c_str(), shards.size(),
                shards.size() == 1 ? "" : "s", FormatBytes(total).c_str(), updates.size(),
                o.out.c_str());
  } catch (...) {
    RemoveTree(tmp);
    throw;
  }
}

void MergeLlmCheckpoint(const MergeOptions& o, const std::vector<AdapterArg>& args) {
  const Checkpoint base = Checkpoint::Open(o.base);
  const Updates updates = LlmUpdates(
      args, base.config(), [&](const std::string& n) { return base.Has(n); }, o.base);
  std::vector<Source> sources;
  for (const Checkpoint::Ref& r : base.AllTensors()) sources.push_back(FileSource(r.file, r.entry));
  WriteLlmFolder(o, args, sources, updates,
                 ConfigWithDtype((fs::path(o.base) / "config.json").string(), o.dtype), o.base);
}

// A store: its weights as the worker computes with them (a compressed store's expanded into
// its dtype, bf16), the config from its manifest, the other files from the folder it was
// loaded from when this host still has it.
void MergeLlmStore(const MergeOptions& o, const std::vector<AdapterArg>& args) {
  const BaseWeights base = BaseWeights::FromStore(o.base);
  const Manifest& m = *base.manifest();
  const ModelConfig& config = base.config();
  const std::string compression = m.DescribeCompression();
  if (!compression.empty())
    std::fprintf(stderr,
                 "merge: store `%s` is compressed (%s): merging into its dequantised %s "
                 "weights, not the original checkpoint's\n",
                 o.base.c_str(), compression.c_str() + 2, DTypeName(m.dtype));
  std::vector<Source> sources;
  auto add = [&](const std::string& name, std::function<at::Tensor()> load) {
    const at::Tensor probe = load();  // shapes and dtypes of views: no copy but a packed one
    sources.push_back({name, DTypeOf(probe.scalar_type()), probe.sizes().vec(), std::move(load)});
  };
  // A compressed table expanded whole (bf16): ExpandPackedRows over all of its rows.
  auto expanded = [](const PackedWeight& w) {
    at::Tensor out = at::empty({w.rows(), w.cols()}, at::kBFloat16);
    at::Tensor staging;
    ExpandPackedRows(w, w.bytes, 0, w.rows(), out, &staging);
    return out;
  };
  const RestWeights& rest = base.rest();
  if (rest.packed_embed.defined())
    sources.push_back({"model.embed_tokens.weight",
                       DType::kBF16,
                       {rest.packed_embed.rows(), rest.packed_embed.cols()},
                       [&] { return expanded(rest.packed_embed); }});
  else
    add("model.embed_tokens.weight", [&] { return rest.embed_tokens; });
  for (int i = 0; i < base.num_blocks(); ++i) {
    std::set<std::string> scales;  // a compressed weight's auxiliary tensors
    for (const TensorSlice& t : m.blocks.at(i).tensors)
      if (t.quant.compressed())
        for (const QuantAuxTensor& aux : QuantAuxTensors(t.name, t.shape, t.quant))
          scales.insert(aux.name);
    for (const TensorSlice& t : m.blocks.at(i).tensors) {
      if (scales.count(t.name)) continue;
      // A compressed weight is expanded into the store's dtype (when first read, then kept:
      // the host holds the expanded model by the end, as a worker computing on the CPU does).
      sources.push_back({"model.layers." + std::to_string(i) + "." + t.name,
                         t.quant.compressed() ? m.dtype : t.dtype, t.shape,
                         [&base, i, n = t.name] { return *BlockWeightField(base.block(i), n); }});
    }
  }
  add("model.norm.weight", [&] { return rest.norm; });
  if (!config.tie_word_embeddings) {
    if (rest.packed_head.defined())
      sources.push_back(
          {"lm_head.weight", DType::kBF16, {rest.packed_head.rows(), rest.packed_head.cols()}, [&] {
             return expanded(rest.packed_head);
           }});
    else
      add("lm_head.weight", [&] { return rest.lm_head; });
  }
  std::set<std::string> names;
  for (const Source& src : sources) names.insert(src.name);
  const Updates updates = LlmUpdates(
      args, config, [&](const std::string& n) { return names.count(n) > 0; }, o.base);
  nlohmann::json cfg;
  ToJson(cfg, config);
  cfg["torch_dtype"] = o.dtype == "bf16" ? "bfloat16" : "float32";
  WriteLlmFolder(o, args, sources, updates, cfg.dump(2) + "\n", m.source_dir);
}

// ---- FLUX: BFL's single file ------------------------------------------------------------

void MergeFlux(const MergeOptions& o, const std::vector<AdapterArg>& args) {
  if (DetectFluxCheckpoint(o.base) != FluxCheckpointKind::kBflFile)
    throw Error(ErrorCode::kUnsupported,
                o.base +
                    ": merge reads FLUX.1 as BFL's single file (flux1-dev.safetensors), "
                    "not a diffusers folder");
  const SafetensorsFile base = SafetensorsFile::Open(o.base);
  const FluxConfig config = FluxConfigFromHeader(base.header(), o.base);
  Updates updates;
  std::vector<flux::FluxAdapter> adapters;
  for (const AdapterArg& arg : args) {
    adapters.push_back(flux::ReadKohyaAdapter(arg.path, config, at::kCPU));
    const flux::FluxAdapter& a = adapters.back();
    for (const auto& [module, m] : a.modules())
      updates[module + ".weight"].push_back({m.a.detach(), m.b.detach(), arg.weight * a.scale()});
  }
  const c10::ScalarType out = OutType(o.dtype);
  std::vector<Source> sources;
  uint64_t total = 0;
  for (const SafetensorsEntry& e : base.tensors()) {
    sources.push_back(FileSource(&base, &e));
    total += OutputBytes(sources.back(), out);
  }
  const std::string tmp = PrepareOutput(o);
  try {
    Progress progress(o.progress, total, "writing " + o.out);
    WriteMerged(tmp, sources, updates, out, base.header().metadata, progress);
    Publish(tmp, o.out);
  } catch (...) {
    RemoveTree(tmp);
    throw;
  }
  std::printf("merged %s into %s: %s (one BFL file, %s, %zu weights changed) -> %s\n",
              Describe(args).c_str(), o.base.c_str(), o.dtype.c_str(), FormatBytes(total).c_str(),
              updates.size(), o.out.c_str());
}

}  // namespace

void RunMerge(const MergeOptions& options) {
  MergeOptions o = options;
  while (o.out.size() > 1 && o.out.back() == '/') o.out.pop_back();
  if (o.adapters.empty())
    throw Error(ErrorCode::kInvalidArgument, "merge: name at least one --adapter");
  OutType(o.dtype);
  std::vector<AdapterArg> args;
  for (const std::string& a : o.adapters) args.push_back(ParseAdapterArg(a));
  std::error_code ec;
  if (!fs::exists(o.base, ec))
    MergeLlmStore(o, args);  // not a path: a store's name (refused naming it when there is none)
  else if (IsFluxCheckpointPath(o.base))
    MergeFlux(o, args);
  else
    MergeLlmCheckpoint(o, args);
}

}  // namespace lorastream::worker
