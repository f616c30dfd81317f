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
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "common/durable_file.h"
#include "common/error.h"
#include "common/flux_config.h"
#include "common/format_bytes.h"
#include "common/remove_tree.h"
#include "common/safetensors.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_model.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"

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

// The base tensors as they are written: name, output dtype and shape, and where they are read.
struct Source {
  std::string name;
  const SafetensorsFile* file;
  const SafetensorsEntry* entry;
};

// Tensor `s` of the output: merged with its updates (in f32) and cast when floating, its bytes
// as they are otherwise.
at::Tensor OutputTensor(const Source& s, const Updates& updates, c10::ScalarType out) {
  const SafetensorsEntry& e = *s.entry;
  if (!IsFloating(e.dtype)) return at::Tensor();
  at::Tensor w = at::from_blob(const_cast<uint8_t*>(s.file->Data(e)), e.shape,
                               at::TensorOptions().dtype(ScalarTypeOf(e.dtype, s.name)));
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
    t.dtype = IsFloating(s.entry->dtype) ? DTypeOf(out) : s.entry->dtype;
    t.shape = s.entry->shape;
    entries.push_back(t);
  }
  size_t current = SIZE_MAX;
  at::Tensor tensor;
  const uint8_t* bytes = nullptr;
  c10::NoGradGuard no_grad;
  WriteSafetensorsStreamed(
      path, entries,
      [&](size_t index, uint64_t offset, uint8_t* dst, size_t n) {
        if (index != current) {
          current = index;
          tensor = OutputTensor(sources[index], updates, out);
          bytes = tensor.defined() ? static_cast<const uint8_t*>(tensor.data_ptr())
                                   : sources[index].file->Data(*sources[index].entry);
        }
        std::memcpy(dst, bytes + offset, n);
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

// "model.layers.3.self_attn.q_proj.weight": the base weight a peft key adapts.
std::string LlmWeightName(int block, int target) {
  return "model.layers." + std::to_string(block) + "." + LoraTargetModule(target) + "." +
         LoraTargetName(target) + ".weight";
}

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

void MergeLlm(const MergeOptions& o, const std::vector<AdapterArg>& args) {
  const Checkpoint base = Checkpoint::Open(o.base);
  const ModelConfig& config = base.config();
  std::vector<LoraAdapter> adapters;
  Updates updates;
  for (const AdapterArg& arg : args) {
    adapters.push_back(LoraAdapter::Load(arg.path, config, at::kCPU));
    const LoraAdapter& a = adapters.back();
    for (int i = 0; i < a.num_blocks(); ++i)
      for (int t = 0; t < kNumLoraTargets; ++t) {
        if (!a.settings().targets[t]) continue;
        const std::string name = LlmWeightName(i, t);
        if (!base.Has(name))
          throw Error(ErrorCode::kRefused,
                      arg.path + " adapts `" + name + "`, which " + o.base + " does not hold");
        updates[name].push_back({a.block(i).a[t].detach(), a.block(i).b[t].detach(),
                                 arg.weight * a.settings().Scale()});
      }
  }
  const c10::ScalarType out = OutType(o.dtype);
  const std::string tmp = PrepareOutput(o);
  fs::create_directories(tmp);
  try {
    // Shards in the base's order, each at most max_shard_bytes (a larger tensor alone).
    std::vector<std::vector<Source>> shards(1);
    uint64_t shard_bytes = 0, total = 0;
    for (const Checkpoint::Ref& r : base.AllTensors()) {
      const uint64_t n = IsFloating(r.entry->dtype) ? r.entry->numel() * DTypeSize(DTypeOf(out))
                                                    : r.entry->nbytes();
      if (shard_bytes > 0 && shard_bytes + n > o.max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().push_back({r.entry->name, r.file, r.entry});
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
    // Everything beside the weights: config (its dtype updated), tokenizer files, generation
    // config, chat template.
    for (const auto& entry : fs::directory_iterator(o.base)) {
      if (!entry.is_regular_file()) continue;
      const std::string file = entry.path().filename().string();
      const bool weights = entry.path().extension() == ".safetensors" ||
                           file == "model.safetensors.index.json" ||
                           entry.path().extension() == ".bin" || entry.path().extension() == ".pt";
      if (weights) continue;
      const std::string to = (fs::path(tmp) / file).string();
      if (file == "config.json")
        WriteFileDurably(to, ConfigWithDtype(entry.path().string(), o.dtype));
      else
        fs::copy_file(entry.path(), to, fs::copy_options::overwrite_existing);
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
    sources.push_back({e.name, &base, &e});
    total += IsFloating(e.dtype) ? e.numel() * DTypeSize(DTypeOf(out)) : e.nbytes();
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
    throw Error(ErrorCode::kNotFound,
                o.base +
                    ": no such checkpoint (merge reads a Hugging Face folder or BFL's "
                    "FLUX.1 file)");
  if (IsFluxCheckpointPath(o.base))
    MergeFlux(o, args);
  else
    MergeLlm(o, args);
}

}  // namespace lorastream::worker
