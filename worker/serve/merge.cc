#include "worker/serve/merge.h"

#include <unistd.h>

#include <algorithm>
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

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/formats/flux_config.h"
#include "common/formats/flux_diffusers.h"
#include "common/formats/flux_layout.h"
#include "common/formats/manifest.h"
#include "common/formats/quant_format.h"
#include "common/formats/safetensors.h"
#include "common/posix/durable_file.h"
#include "common/posix/regular_file.h"
#include "common/posix/remove_tree.h"
#include "store/attach.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_model.h"
#include "worker/model/base_weights.h"
#include "worker/model/block_weights.h"
#include "worker/model/lora.h"
#include "worker/model/packed_weight.h"
#include "worker/model/quant_expand.h"

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
// A diffusers tensor that holds some rows of a fused BFL one takes those rows of B, from its
// row `row` on.
struct Update {
  at::Tensor a, b;
  double factor = 1.0;  // the adapter's weight times its scale
  int64_t row = 0;      // the first row of the weight that b's rows update
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
  for (const Update& u : it->second)
    merged.narrow(0, u.row, u.b.size(0)).add_(at::matmul(u.b, u.a), u.factor);
  return merged.to(out).contiguous();
}

// A tensor merge cannot compute with (an fp8 FLUX file's linear): a store of the base can.
[[noreturn]] void RefuseNotFloating(const std::string& base, const std::string& tensor,
                                    DType dtype) {
  throw Error(ErrorCode::kUnsupported,
              base + ": tensor `" + tensor + "` is stored as " + DTypeName(dtype) +
                  ", which merge does not compute with; publish the base as a store "
                  "(lorastream-store serve " +
                  base + " --name NAME, which expands it) and merge with --base NAME");
}

// Refuses (before anything is written) an update of a tensor the base does not hold, of one
// that is not floating (an fp8 file's weight) or of another shape than its B A.
void CheckUpdates(const std::vector<Source>& sources, const Updates& updates,
                  const std::string& base) {
  std::map<std::string, const Source*> by_name;
  for (const Source& s : sources) by_name[s.name] = &s;
  for (const auto& [name, list] : updates) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      throw Error(ErrorCode::kRefused,
                  "an adapter adapts `" + name + "`, which " + base + " does not hold");
    const Source& s = *it->second;
    if (!IsFloating(s.dtype)) RefuseNotFloating(base, name, s.dtype);
    for (const Update& u : list)
      if (s.shape.size() != 2 || u.a.dim() != 2 || u.b.dim() != 2 || u.a.size(1) != s.shape[1] ||
          u.row < 0 || u.row + u.b.size(0) > s.shape[0])
        throw Error(ErrorCode::kRefused,
                    "an adapter's update of `" + name + "` (B " + ShapeString(u.b.sizes().vec()) +
                        ", A " + ShapeString(u.a.sizes().vec()) + ") does not fit its shape " +
                        ShapeString(s.shape) + " in " + base);
  }
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

// Moves `tmp` to `out`, replacing what is there (PrepareOutput refused it without --force): a
// file by a file in one rename; a folder, or anything by a folder, moved aside first.
void Publish(const std::string& tmp, const std::string& out) {
  std::error_code ec;
  if (fs::is_directory(out, ec) || (fs::is_directory(tmp, ec) && fs::exists(out, ec))) {
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

// `sources` with `updates` folded in, written into the folder `dir` as STEM-0000i-of-0000N
// .safetensors shards in the sources' order (each at most max_shard_bytes; a larger tensor
// alone) and their index STEM.safetensors.index.json; a single shard is STEM.safetensors
// without an index unless `index_always`. Returns the shard count; adds the bytes to *total.
size_t WriteShards(const MergeOptions& o, const std::string& dir, const std::string& stem,
                   bool index_always, const std::vector<Source>& sources, const Updates& updates,
                   uint64_t* total) {
  const c10::ScalarType out = OutType(o.dtype);
  std::vector<std::vector<Source>> shards(1);
  uint64_t shard_bytes = 0;
  *total = 0;
  for (const Source& src : sources) {
    const uint64_t n = OutputBytes(src, out);
    if (shard_bytes > 0 && shard_bytes + n > o.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(src);
    shard_bytes += n;
    *total += n;
  }
  Progress progress(o.progress, *total, "writing " + o.out);
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[96];
    std::snprintf(name, sizeof name, "%s-%05zu-of-%05zu.safetensors", stem.c_str(), s + 1,
                  shards.size());
    const std::string file =
        shards.size() == 1 && !index_always ? stem + ".safetensors" : std::string(name);
    WriteMerged((fs::path(dir) / file).string(), shards[s], updates, out, {{"format", "pt"}},
                progress);
    for (const Source& src : shards[s]) weight_map[src.name] = file;
  }
  if (shards.size() > 1 || index_always) {
    nlohmann::json index{{"metadata", {{"total_size", *total}}}, {"weight_map", weight_map}};
    WriteFileDurably((fs::path(dir) / (stem + ".safetensors.index.json")).string(),
                     index.dump(2) + "\n");
  }
  return shards.size();
}

// Writes the output through `write(tmp)` under a temporary name beside --out, then renames it
// into place; the temporary is removed when anything fails.
void WriteAndPublish(const MergeOptions& o, const std::function<void(const std::string&)>& write) {
  const std::string tmp = PrepareOutput(o);
  try {
    write(tmp);
    Publish(tmp, o.out);
  } catch (...) {
    RemoveTree(tmp);
    throw;
  }
}

// A Hugging Face folder of `sources` with `updates` folded in: shards and their index,
// `config_json`, and every other file of `beside` (a checkpoint folder: tokenizer, generation
// config, chat template) but its weights and config. `note`: what the summary line adds.
void WriteLlmFolder(const MergeOptions& o, const std::vector<AdapterArg>& args,
                    const std::vector<Source>& sources, const Updates& updates,
                    const std::string& config_json, const std::string& beside,
                    const std::string& note = "") {
  CheckUpdates(sources, updates, o.base);
  size_t shards = 0;
  uint64_t total = 0;
  WriteAndPublish(o, [&](const std::string& tmp) {
    fs::create_directories(tmp);
    shards = WriteShards(o, tmp, "model", /*index_always=*/true, sources, updates, &total);
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
  });
  std::printf("merged %s into %s%s: %s (%zu shard%s, %s, %zu weights changed) -> %s\n",
              Describe(args).c_str(), o.base.c_str(), note.c_str(), o.dtype.c_str(), shards,
              shards == 1 ? "" : "s", FormatBytes(total).c_str(), updates.size(), o.out.c_str());
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

// ---- Stores (either family) -------------------------------------------------------------

// The tensors of store segment `seg` as merge writes them, named PREFIX + their segment name:
// a compressed weight as its dequantised values in the store's dtype `dtype` (its scales are
// not written), every other tensor as stored; `load(name)` reads one by its segment name.
void AddSegmentSources(const SegmentInfo& seg, DType dtype, const std::string& prefix,
                       const std::function<at::Tensor(const std::string&)>& load,
                       std::vector<Source>* out) {
  std::set<std::string> scales;  // a compressed weight's auxiliary tensors
  for (const TensorSlice& t : seg.tensors)
    if (t.quant.compressed())
      for (const QuantAuxTensor& aux : QuantAuxTensors(t.name, t.shape, t.quant))
        scales.insert(aux.name);
  for (const TensorSlice& t : seg.tensors) {
    if (scales.count(t.name)) continue;
    out->push_back({prefix + t.name, t.quant.compressed() ? dtype : t.dtype, t.shape,
                    [load, n = t.name] { return load(n); }});
  }
}

// What merging from store `name` adds to the summary line: for a compressed store, that its
// dequantised weights were merged (said on stderr as well, before the work starts).
std::string StoreNote(const Manifest& m, const std::string& name) {
  const std::string compression = m.DescribeCompression();
  if (compression.empty()) return "";
  std::fprintf(stderr,
               "merge: store `%s` is compressed (%s): merging into its dequantised %s "
               "weights, not the original checkpoint's\n",
               name.c_str(), compression.c_str() + 2, DTypeName(m.dtype));
  return std::string(" (compressed") + compression + ": its dequantised " + DTypeName(m.dtype) +
         " weights)";
}

// An LLM store: its weights as the worker computes with them (a compressed store's expanded
// into its dtype), the config from its manifest, the other files from the folder it was
// loaded from when this host still has it.
void MergeLlmStore(const MergeOptions& o, const std::vector<AdapterArg>& args) {
  const BaseWeights base = BaseWeights::FromStore(o.base);
  const Manifest& m = *base.manifest();
  const ModelConfig& config = base.config();
  const std::string note = StoreNote(m, o.base);
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
  // A compressed weight is expanded into the store's dtype when its block is first read, then
  // kept: the host holds the expanded model by the end, as a worker computing on the CPU does.
  for (int i = 0; i < base.num_blocks(); ++i)
    AddSegmentSources(
        m.blocks.at(i), m.dtype, "model.layers." + std::to_string(i) + ".",
        [&base, i](const std::string& n) { return *BlockWeightField(base.block(i), n); }, &sources);
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
  WriteLlmFolder(o, args, sources, updates, cfg.dump(2) + "\n", m.source_dir, note);
}

// ---- FLUX.1: BFL's single file, a diffusers folder or a store -----------------------------

// A FLUX.1 base as merge reads it: every tensor under BFL's name, and a diffusers base's own
// tensors under theirs (written as they are when the output is a diffusers folder too).
struct FluxSources {
  FluxConfig config;
  std::vector<Source> bfl;                      // FluxAllShapes' tensors
  std::vector<Source> diffusers;                // a diffusers base's, in FluxDiffusersShapes order
  std::map<std::string, std::string> metadata;  // a BFL file's (kept in a BFL output)
  std::string diffusers_config;                 // a diffusers base's transformer/config.json
  std::string form;                             // the base's own: "bfl" (a store too), "diffusers"
  std::string note;                             // what the summary line adds (a compressed store)
  std::shared_ptr<const void> keep;             // what the sources read from
};

FluxSources FluxFromCheckpoint(const std::string& path) {
  auto reader = std::make_shared<const FluxCheckpointReader>(FluxCheckpointReader::Open(path));
  FluxSources f;
  f.keep = reader;
  f.config = reader->config();
  f.form = reader->is_diffusers() ? "diffusers" : "bfl";
  std::map<std::string, FluxCheckpointReader::Piece> own;  // a diffusers base's, by its names
  for (const auto& [name, shape] : FluxAllShapes(f.config)) {
    const std::vector<FluxCheckpointReader::Piece> pieces = reader->Pieces(name);
    if (!reader->is_diffusers()) {  // BFL's file: its tensor as it is
      f.bfl.push_back(FileSource(pieces[0].file, pieces[0].entry));
      f.metadata = pieces[0].file->header().metadata;
      continue;
    }
    for (const FluxCheckpointReader::Piece& p : pieces) {
      if (!IsFloating(p.entry->dtype)) RefuseNotFloating(path, p.entry->name, p.entry->dtype);
      own[p.entry->name] = p;
    }
    // BFL's tensor: the diffusers tensors' runs of rows, joined.
    DType dtype = pieces[0].entry->dtype;
    for (const auto& p : pieces)
      if (p.entry->dtype != dtype) dtype = DType::kF32;
    f.bfl.push_back({name, dtype, shape, [pieces, dtype] {
                       std::vector<at::Tensor> rows;
                       for (const FluxCheckpointReader::Piece& p : pieces)
                         rows.push_back(FileSource(p.file, p.entry)
                                            .load()
                                            .narrow(0, p.source_row, p.rows)
                                            .to(ScalarTypeOf(dtype, p.entry->name)));
                       return rows.size() == 1 ? rows[0] : at::cat(rows, 0);
                     }});
  }
  if (reader->is_diffusers()) {
    for (const auto& [name, shape] : FluxDiffusersShapes(f.config))
      f.diffusers.push_back(FileSource(own.at(name).file, own.at(name).entry));
    const fs::path dir = fs::path(path) / "transformer";
    const fs::path config = fs::is_regular_file(dir / "config.json")
                                ? dir / "config.json"
                                : fs::path(path) / "config.json";
    f.diffusers_config = ReadRegularFile(config.string(), kMaxTextFileBytes, "config.json");
  }
  return f;
}

// A FLUX.1 store: the tensors outside the units as stored, each unit's as the worker computes
// with them (a compressed store's linears dequantised into its dtype, one unit at a time).
FluxSources FluxFromStore(std::shared_ptr<const store::AttachedStore> store,
                          const std::string& name) {
  const Manifest& m = store->manifest();
  FluxSources f;
  f.keep = store;
  f.config = m.flux;
  f.form = "bfl";
  f.note = StoreNote(m, name);
  const store::AttachedStore* s = store.get();
  AddSegmentSources(
      m.rest, m.dtype, "",
      [s](const std::string& n) {
        const TensorSlice* t = s->manifest().rest.Find(n);
        return at::from_blob(const_cast<uint8_t*>(s->rest_data() + t->offset), t->shape,
                             at::TensorOptions().dtype(ScalarTypeOf(t->dtype, n)));
      },
      &f.bfl);
  // The unit last expanded (the sources are read in order: unit by unit).
  auto expanded = std::make_shared<std::pair<int, BlockWeights>>(-1, BlockWeights{});
  const c10::ScalarType type = ScalarTypeOf(m.dtype, "store `" + name + "`");
  for (int u = 0; u < s->num_blocks(); ++u)
    AddSegmentSources(
        m.blocks[u], m.dtype, "",
        [s, expanded, type, u](const std::string& n) {
          if (expanded->first != u) {
            const at::Tensor bytes = at::from_blob(const_cast<uint8_t*>(s->block_data(u)),
                                                   {static_cast<int64_t>(s->block_size(u))},
                                                   at::TensorOptions().dtype(at::kByte));
            at::Tensor buffer;
            expanded->second =
                ExpandBlock(bytes, s->manifest().blocks[u], type, &buffer, BlockNaming::kByName);
            expanded->first = u;
          }
          return expanded->second.named.at(n);
        },
        &f.bfl);
  return f;
}

// BFL's tensors `bfl` as diffusers' (FluxDiffusersParts: each a run of rows of one or more of
// them), and the updates of BFL's weights as updates of those rows.
std::vector<Source> FluxDiffusersSources(const FluxConfig& c, const std::vector<Source>& bfl,
                                         const std::string& base) {
  std::map<std::string, const Source*> by_name;
  for (const Source& s : bfl) by_name[s.name] = &s;
  std::map<std::string, std::vector<FluxDiffusersPart>> parts;
  for (const FluxDiffusersPart& p : FluxDiffusersParts(c)) parts[p.diffusers].push_back(p);
  std::vector<Source> out;
  for (const auto& [name, shape] : FluxDiffusersShapes(c)) {
    std::vector<std::pair<FluxDiffusersPart, const Source*>> runs;
    for (const FluxDiffusersPart& p : parts.at(name)) runs.push_back({p, by_name.at(p.bfl)});
    std::sort(runs.begin(), runs.end(), [](const auto& x, const auto& y) {
      return x.first.diffusers_row < y.first.diffusers_row;
    });
    for (const auto& [p, src] : runs)
      if (!IsFloating(src->dtype)) RefuseNotFloating(base, p.bfl, src->dtype);
    const DType dtype = runs[0].second->dtype;
    out.push_back({name, dtype, shape, [runs, dtype, name] {
                     std::vector<at::Tensor> rows;
                     for (const auto& [p, src] : runs)
                       rows.push_back(
                           src->load().narrow(0, p.bfl_row, p.rows).to(ScalarTypeOf(dtype, name)));
                     return rows.size() == 1 ? rows[0] : at::cat(rows, 0);
                   }});
  }
  return out;
}

Updates FluxDiffusersUpdates(const FluxConfig& c, const Updates& bfl) {
  Updates out;
  for (const FluxDiffusersPart& p : FluxDiffusersParts(c)) {
    auto it = bfl.find(p.bfl);
    if (it == bfl.end()) continue;
    for (const Update& u : it->second)
      out[p.diffusers].push_back(
          {u.a, u.b.narrow(0, p.bfl_row, p.rows), u.factor, p.diffusers_row});
  }
  return out;
}

void MergeFlux(const MergeOptions& o, const std::vector<AdapterArg>& args, const FluxSources& f) {
  const std::string form = o.format.empty() ? f.form : o.format;
  Updates updates;  // by BFL name
  std::vector<flux::FluxAdapter> adapters;
  for (const AdapterArg& arg : args) {
    adapters.push_back(flux::ReadKohyaAdapter(arg.path, f.config, at::kCPU));
    const flux::FluxAdapter& a = adapters.back();
    for (const auto& [module, m] : a.modules())
      updates[module + ".weight"].push_back({m.a.detach(), m.b.detach(), arg.weight * a.scale()});
  }
  CheckUpdates(f.bfl, updates, o.base);
  const c10::ScalarType out = OutType(o.dtype);
  uint64_t total = 0;
  std::string written;
  if (form == "bfl") {
    for (const Source& s : f.bfl) total += OutputBytes(s, out);
    WriteAndPublish(o, [&](const std::string& tmp) {
      Progress progress(o.progress, total, "writing " + o.out);
      WriteMerged(tmp, f.bfl, updates, out,
                  f.metadata.empty() ? FluxMetadata(f.config) : f.metadata, progress);
    });
    written = "BFL's single file";
  } else {
    const std::vector<Source> sources =
        f.diffusers.empty() ? FluxDiffusersSources(f.config, f.bfl, o.base) : f.diffusers;
    const Updates diffusers_updates = FluxDiffusersUpdates(f.config, updates);
    CheckUpdates(sources, diffusers_updates, o.base);
    const std::string config =
        f.diffusers_config.empty() ? FluxDiffusersConfigJson(f.config) : f.diffusers_config;
    size_t shards = 0;
    WriteAndPublish(o, [&](const std::string& tmp) {
      const std::string dir = (fs::path(tmp) / "transformer").string();
      fs::create_directories(dir);
      shards = WriteShards(o, dir, "diffusion_pytorch_model", /*index_always=*/false, sources,
                           diffusers_updates, &total);
      WriteFileDurably((fs::path(dir) / "config.json").string(), config);
      FsyncFolder(dir);
      FsyncFolder(tmp);
    });
    written = "a diffusers folder, transformer/ in " + std::to_string(shards) + " shard" +
              (shards == 1 ? "" : "s");
  }
  std::printf("merged %s into %s%s: %s (%s, %s, %zu weights changed) -> %s\n",
              Describe(args).c_str(), o.base.c_str(), f.note.c_str(), o.dtype.c_str(),
              written.c_str(), FormatBytes(total).c_str(), updates.size(), o.out.c_str());
}

}  // namespace

void RunMerge(const MergeOptions& options) {
  MergeOptions o = options;
  while (o.out.size() > 1 && o.out.back() == '/') o.out.pop_back();
  if (o.adapters.empty())
    throw Error(ErrorCode::kInvalidArgument, "merge: name at least one --adapter");
  OutType(o.dtype);
  if (!o.format.empty() && o.format != "bfl" && o.format != "diffusers")
    throw Error(ErrorCode::kInvalidArgument,
                "--format " + o.format + ": bfl or diffusers (FLUX.1's two forms)");
  std::vector<AdapterArg> args;
  for (const std::string& a : o.adapters) args.push_back(ParseAdapterArg(a));
  auto llm = [&] {
    if (!o.format.empty())
      throw Error(ErrorCode::kInvalidArgument,
                  "--format " + o.format +
                      " is for a FLUX.1 base; an LLM is merged into a Hugging Face folder");
  };
  std::error_code ec;
  if (!fs::exists(o.base, ec)) {
    // Not a path: a store's name (refused naming it when there is none).
    auto store = std::make_shared<const store::AttachedStore>(store::AttachedStore::Attach(o.base));
    if (store->manifest().is_flux()) {
      MergeFlux(o, args, FluxFromStore(store, o.base));
    } else {
      store.reset();
      llm();
      MergeLlmStore(o, args);
    }
  } else if (IsFluxCheckpointPath(o.base)) {
    MergeFlux(o, args, FluxFromCheckpoint(o.base));
  } else {
    llm();
    MergeLlmCheckpoint(o, args);
  }
}

}  // namespace lorastream::worker
