#include "store/layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/finite_scan.h"
#include "common/base/log.h"
#include "common/formats/tokenizer_id.h"
#include "store/convert.h"
#include "store/parallel.h"
#include "store/progress.h"

namespace lorastream::store {

namespace {

// "model.layers.12.mlp.up_proj.weight" -> (12, "mlp.up_proj.weight"); -1 for other names.
std::pair<int64_t, std::string> SplitBlockName(const std::string& name) {
  static const std::string kPrefix = "model.layers.";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return {-1, ""};
  size_t i = kPrefix.size(), j = i;
  while (j < name.size() && j - i < 9 && name[j] >= '0' && name[j] <= '9') ++j;
  if (j == i || j >= name.size() || name[j] != '.') return {-1, ""};
  return {std::stoll(name.substr(i, j - i)), name.substr(j + 1)};
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

[[noreturn]] void Fail(const std::string& dir, const std::string& what) {
  throw Error(ErrorCode::kCorrupt, dir + ": " + what);
}

// The tensors a pre-quantised checkpoint keeps beside projection weight `weight`.
std::vector<std::string> CheckpointAuxNames(const std::string& weight, const QuantInfo& q) {
  if (q.method == QuantMethod::kFp8) return {weight + "_scale_inv"};
  return {weight + ".absmax", weight + ".nested_absmax", weight + ".quant_map",
          weight + ".nested_quant_map", weight + ".quant_state.bitsandbytes__nf4"};
}

// The largest nested_offset (a mean of weights' absmax) a pre-quantised checkpoint may hold.
constexpr double kMaxNf4NestedOffset = 1e6;

struct Nf4State {
  int64_t blocksize = 0, nested_blocksize = 0;
  float offset = 0;
};

// bitsandbytes' quant_state of nf4 weight `full` (a U8 tensor holding JSON), checked against
// the weight's logical shape `shape`.
Nf4State ReadNf4State(const Checkpoint& cp, const std::string& full,
                      const std::vector<int64_t>& shape) {
  const std::string name = full + ".quant_state.bitsandbytes__nf4";
  if (!cp.Has(name)) Fail(cp.dir(), "tensor `" + name + "` is missing");
  const Checkpoint::Ref ref = cp.Get(name);
  const auto* data = reinterpret_cast<const char*>(ref.file->Data(*ref.entry));
  const nlohmann::json j =
      nlohmann::json::parse(data, data + ref.entry->nbytes(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) -> Nf4State {
    Fail(cp.dir(), "tensor `" + name + "`: " + why);
  };
  if (!j.is_object()) bad("not a JSON object");
  if (!j.contains("quant_type") || j["quant_type"] != "nf4") bad("quant_type is not nf4");
  Nf4State st;
  for (auto [key, out] : {std::pair{"blocksize", &st.blocksize},
                          std::pair{"nested_blocksize", &st.nested_blocksize}}) {
    if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() <= 0 ||
        j[key].get<int64_t>() > (1 << 20))
      bad(std::string("`") + key + "` must be a positive integer");
    *out = j[key].get<int64_t>();
  }
  if (!j.contains("nested_offset") || !j["nested_offset"].is_number())
    bad("`nested_offset` must be a number (double quantisation)");
  // The mean of the blocks' absmax that double quantisation took out: a value a float cannot
  // hold, or one far beyond any weight's scale, would publish a store whose every weight is
  // infinite (a loss of NaN steps later, blamed on the learning rate).
  const double offset = j["nested_offset"].get<double>();
  if (!std::isfinite(offset) || std::fabs(offset) > kMaxNf4NestedOffset)
    bad("`nested_offset` is " + j["nested_offset"].dump() + ", not a finite number of at most " +
        std::to_string(static_cast<int64_t>(kMaxNf4NestedOffset)) +
        " in magnitude (the mean of the blocks' absmax)");
  st.offset = static_cast<float>(offset);
  if (!j.contains("shape") || j["shape"] != nlohmann::json(shape))
    bad("`shape` is not the weight's " + ShapeString(shape));
  return st;
}
Nf4State ReadNf4State(const Checkpoint& cp, const std::string& full, const TensorSlice& weight) {
  return ReadNf4State(cp, full, weight.shape);
}

// The format of a pre-quantised checkpoint's projection weights: config.json's, with nf4's
// block sizes from the quant_state of each weight (all of them the same).
QuantInfo CheckpointQuant(const Checkpoint& cp,
                          const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                          QuantInfo q) {
  if (q.method != QuantMethod::kNf4) return q;
  bool first = true;
  for (int64_t i = 0; i < cp.config().num_hidden_layers; ++i) {
    for (const auto& [rel, shape] : shapes) {
      if (!IsProjectionWeight(rel)) continue;
      const std::string full = "model.layers." + std::to_string(i) + "." + rel;
      const Nf4State st = ReadNf4State(cp, full, shape);
      if (first) {
        q.blocksize = st.blocksize;
        q.nested_blocksize = st.nested_blocksize;
        first = false;
      } else if (st.blocksize != q.blocksize || st.nested_blocksize != q.nested_blocksize) {
        Fail(cp.dir(), "tensor `" + full + "` has nf4 blocksize " + std::to_string(st.blocksize) +
                           "/" + std::to_string(st.nested_blocksize) +
                           " but the first projection has " + std::to_string(q.blocksize) + "/" +
                           std::to_string(q.nested_blocksize) + "; a store holds one format");
      }
    }
  }
  if (q.blocksize % 2 != 0) Fail(cp.dir(), "nf4 blocksize must be even");
  return q;
}

// A pre-quantised weight: its stored dtype and exactly the bytes its format needs.
void RequireStoredWeight(const Checkpoint::Ref& ref, const TensorSlice& t, const std::string& dir) {
  const std::string& name = ref.entry->name;
  if (ref.entry->dtype != t.dtype)
    Fail(dir, "tensor `" + name + "` is " + DTypeName(ref.entry->dtype) + " but " +
                  DescribeQuant(t.quant) + " stores " + DTypeName(t.dtype));
  if (ref.entry->nbytes() != t.nbytes)
    Fail(dir, "tensor `" + name + "` " + ShapeString(ref.entry->shape) + " holds " +
                  std::to_string(ref.entry->nbytes()) + " bytes but " + ShapeString(t.shape) +
                  " in " + DescribeQuant(t.quant) + " needs " + std::to_string(t.nbytes) +
                  (ref.entry->nbytes() < t.nbytes ? " (truncated?)" : ""));
  if (t.quant.method == QuantMethod::kFp8 && ref.entry->shape != t.shape)
    Fail(dir, "tensor `" + name + "` has shape " + ShapeString(ref.entry->shape) +
                  " but config.json implies " + ShapeString(t.shape));
}

// A scale of a pre-quantised weight, of the dtype and shape its format implies.
Checkpoint::Ref StoredAux(const Checkpoint& cp, const std::string& full, const TensorSlice& t) {
  if (!cp.Has(full)) Fail(cp.dir(), "tensor `" + full + "` is missing");
  const Checkpoint::Ref ref = cp.Get(full);
  if (ref.entry->dtype != t.dtype || ref.entry->numel() != static_cast<uint64_t>([&] {
                                       int64_t n = 1;
                                       for (int64_t d : t.shape) n *= d;
                                       return n;
                                     }()))
    Fail(cp.dir(), "tensor `" + full + "` is " + DTypeName(ref.entry->dtype) + " " +
                       ShapeString(ref.entry->shape) + " but its weight's format needs " +
                       DTypeName(t.dtype) + " " + ShapeString(t.shape));
  // fp8 scales must have the tile grid's own shape (a transposed grid has the same count).
  if (t.shape.size() == 2 && ref.entry->shape != t.shape)
    Fail(cp.dir(), "tensor `" + full + "` has shape " + ShapeString(ref.entry->shape) +
                       " but its weight's format needs " + ShapeString(t.shape));
  return ref;
}

}  // namespace

PackPlan PlanPack(const Checkpoint& cp, const PackOptions& options) {
  const ModelConfig& config = cp.config();
  const std::string& dir = cp.dir();
  auto fail = [&](const std::string& what) { throw Error(ErrorCode::kCorrupt, dir + ": " + what); };

  const auto block_shapes = config.BlockTensorShapes();
  const auto rest_shapes = config.RestTensorShapes();
  const QuantInfo& stored_quant = config.checkpoint_quant;  // a pre-quantised checkpoint's
  for (auto [asked, flag] : {std::pair{options.quantize_head, "--quantize-head"},
                             std::pair{options.quantize_embedding, "--quantize-embedding"}})
    if (asked && options.quantize == QuantMethod::kNone)
      throw Error(
          ErrorCode::kInvalidArgument,
          std::string(flag) + " compresses in the blocks' format: give it with --quantize fp8|nf4");
  if (stored_quant.compressed() && options.quantize != QuantMethod::kNone)
    fail("the checkpoint is already quantised (" +
         std::string(QuantMethodName(stored_quant.method)) +
         " in config.json's quantization_config): serve it without --quantize");
  std::set<std::string> block_names, rest_names;
  for (const auto& [name, shape] : block_shapes) {
    block_names.insert(name);
    if (stored_quant.compressed() && IsProjectionWeight(name))
      for (const std::string& aux : CheckpointAuxNames(name, stored_quant)) block_names.insert(aux);
  }
  for (const auto& [name, shape] : rest_shapes) rest_names.insert(name);

  // Classify every tensor of the checkpoint: extras are refused (a few known leftovers
  // of older exports are ignored with a warning).
  std::set<int64_t> blocks_present;
  for (const Checkpoint::Ref& ref : cp.AllTensors()) {
    const std::string& name = ref.entry->name;
    auto [block, rel] = SplitBlockName(name);
    if (block >= 0) {
      if (rel.size() >= 20 && rel.compare(rel.size() - 20, 20, "rotary_emb.inv_freq") == 0)
        continue;
      if (block >= config.num_hidden_layers)
        fail(
            "tensor `" + name + "` belongs to block " + std::to_string(block) +
            " but config.json has num_hidden_layers = " + std::to_string(config.num_hidden_layers));
      if (!block_names.count(rel))
        fail("unexpected tensor `" + name + "` (not part of a " + config.model_type + " block)");
      blocks_present.insert(block);
    } else if (!rest_names.count(name)) {
      if (name == "lm_head.weight" && config.tie_word_embeddings) {
        LS_LOG_WARN("{}: ignoring lm_head.weight: config.json ties it to the embeddings", dir);
        continue;
      }
      fail("unexpected tensor `" + name + "` (not part of a " + config.model_type + " model)");
    }
  }
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    if (!blocks_present.count(i))
      fail("block " + std::to_string(i) + " is missing (no tensor model.layers." +
           std::to_string(i) + ".*; config.json has num_hidden_layers = " +
           std::to_string(config.num_hidden_layers) + ")");

  PackPlan plan;
  Manifest& m = plan.manifest;
  m.config = config;
  m.alignment = options.alignment;
  m.source_dir = dir;
  try {  // the tokenizer is recorded for `submit` and `train`; weights do not depend on it
    if (std::optional<TokenizerId> tokenizer = ModelTokenizerId(dir)) m.tokenizer = *tokenizer;
  } catch (const Error& e) {
    LS_LOG_WARN("{} (the store records no tokenizer)", e.what());
  }
  std::optional<DType> source_dtype;
  std::string first_tensor;
  // Validates one tensor against config.json and records where its bytes come from; the
  // layout itself is LayoutSegment's, the same for every packer.
  auto add = [&](std::vector<Checkpoint::Ref>& sources, const std::string& full,
                 const std::vector<int64_t>& shape) {
    if (!cp.Has(full)) fail("tensor `" + full + "` is missing");
    Checkpoint::Ref ref = cp.Get(full);
    if (ref.entry->shape != shape)
      fail("tensor `" + full + "` has shape " + ShapeString(ref.entry->shape) +
           " but config.json implies " + ShapeString(shape));
    const DType dt = ref.entry->dtype;
    if (!ConvertibleToBF16(dt))
      fail("tensor `" + full + "` is " + DTypeName(dt) +
           "; the store holds floating-point weights (F32, F16, BF16)");
    if (!source_dtype) {
      source_dtype = dt;
      first_tensor = full;
    } else if (*source_dtype != dt && !options.to_bf16) {
      fail("tensor `" + full + "` is " + DTypeName(dt) + " but `" + first_tensor + "` is " +
           DTypeName(*source_dtype) + "; serve with --dtype bf16 to convert all to BF16");
    }
    sources.push_back(ref);
  };
  plan.block_sources.resize(config.num_hidden_layers);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    for (const auto& [rel, shape] : block_shapes) {
      const std::string full = "model.layers." + std::to_string(i) + "." + rel;
      if (stored_quant.compressed() && IsProjectionWeight(rel)) {
        if (!cp.Has(full)) fail("tensor `" + full + "` is missing");
        plan.block_sources[i].push_back(cp.Get(full));  // checked against its format below
      } else {
        add(plan.block_sources[i], full, shape);
      }
    }
  }
  for (const auto& [name, shape] : rest_shapes) add(plan.rest_sources, name, shape);
  m.dtype = options.to_bf16 ? DType::kBF16 : *source_dtype;
  const QuantInfo quant = stored_quant.compressed()
                              ? CheckpointQuant(cp, block_shapes, stored_quant)
                              : StoreQuantFormat(options.quantize);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    m.blocks.push_back(LayoutSegment(block_shapes, "", m.dtype, options.alignment, quant));
    if (!quant.compressed()) continue;
    // Sources parallel to the compressed layout. Quantised here: the weights keep their
    // source in `quantize`, their slices and scales are the loader's to compute. Quantised
    // already: every slice is a tensor of the checkpoint, but nf4's nested_offset, which
    // bitsandbytes keeps in the weight's quant_state.
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    std::vector<Checkpoint::Ref> sources;
    size_t next = 0;  // in plan.block_sources[i], which follows block_shapes
    for (size_t k = 0; k < m.blocks[i].tensors.size(); ++k) {
      const TensorSlice& t = m.blocks[i].tensors[k];
      if (t.quant.compressed() && !stored_quant.compressed()) {
        plan.quantize.push_back({static_cast<size_t>(i), k, {plan.block_sources[i][next++]}});
        sources.push_back({nullptr, nullptr});
      } else if (next < block_shapes.size() && block_shapes[next].first == t.name) {
        if (t.quant.compressed()) RequireStoredWeight(plan.block_sources[i][next], t, dir);
        sources.push_back(plan.block_sources[i][next++]);
      } else if (!stored_quant.compressed()) {
        sources.push_back({nullptr, nullptr});  // a scale of the weight before it
      } else if (EndsWith(t.name, ".nested_offset")) {
        const std::string weight = t.name.substr(0, t.name.size() - 14);
        const float offset = ReadNf4State(cp, prefix + weight, *m.blocks[i].Find(weight)).offset;
        std::vector<uint8_t> bytes(sizeof(float));
        std::memcpy(bytes.data(), &offset, sizeof(float));
        plan.literals.push_back({static_cast<size_t>(i), k, std::move(bytes)});
        sources.push_back({nullptr, nullptr});
      } else {
        sources.push_back(StoredAux(cp, prefix + t.name, t));
      }
    }
    plan.block_sources[i] = std::move(sources);
  }
  // The rest: the LM head and embedding table compressed on request, quantised by the loader
  // as the blocks' weights are.
  std::vector<std::string> rest_compressed;
  if (config.tie_word_embeddings) {  // one table: either flag compresses it
    if (options.quantize_head || options.quantize_embedding)
      rest_compressed.push_back("model.embed_tokens.weight");
  } else {
    if (options.quantize_head) rest_compressed.push_back("lm_head.weight");
    if (options.quantize_embedding) rest_compressed.push_back("model.embed_tokens.weight");
  }
  m.rest = LayoutSegment(rest_shapes, "", m.dtype, options.alignment, quant, rest_compressed);
  if (!rest_compressed.empty()) {
    std::vector<Checkpoint::Ref> sources;
    size_t next = 0;  // in plan.rest_sources, which follows rest_shapes
    for (size_t k = 0; k < m.rest.tensors.size(); ++k) {
      const TensorSlice& t = m.rest.tensors[k];
      if (t.quant.compressed()) {
        plan.quantize.push_back({m.blocks.size(), k, {plan.rest_sources[next++]}});
        sources.push_back({nullptr, nullptr});
      } else if (next < rest_shapes.size() && rest_shapes[next].first == t.name) {
        sources.push_back(plan.rest_sources[next++]);
      } else {
        sources.push_back({nullptr, nullptr});  // a scale of the weight before it
      }
    }
    plan.rest_sources = std::move(sources);
  }
  if (options.scan_weights) RefuseNonFiniteWeights(plan);
  return plan;
}

SegmentInfo& PlanSegment(Manifest& manifest, size_t index) {
  return index < manifest.blocks.size() ? manifest.blocks[index] : manifest.rest;
}
const SegmentInfo& PlanSegment(const Manifest& manifest, size_t index) {
  return index < manifest.blocks.size() ? manifest.blocks[index] : manifest.rest;
}

uint64_t RefuseNonFiniteWeights(const PackPlan& plan, Progress* progress, int threads) {
  std::vector<const Checkpoint::Ref*> refs;
  for (const std::vector<Checkpoint::Ref>& block : plan.block_sources)
    for (const Checkpoint::Ref& ref : block)
      if (ref.file != nullptr) refs.push_back(&ref);  // a pre-quantised tensor scans as its dtype
  for (const PackPlan::Quantize& q : plan.quantize)
    for (const Checkpoint::Ref& ref : q.sources) refs.push_back(&ref);
  for (const Checkpoint::Ref& ref : plan.rest_sources)
    if (ref.file != nullptr) refs.push_back(&ref);  // a quantised one is in plan.quantize
  // Pieces of at most kScanPieceBytes, so that an embedding of a gigabyte is shared out too.
  constexpr uint64_t kScanPieceBytes = 64u << 20;
  struct Piece {
    const Checkpoint::Ref* ref;
    uint64_t begin, count;  // elements
  };
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (const Checkpoint::Ref* ref : refs) {
    const uint64_t numel = ref->entry->numel(), elem = DTypeSize(ref->entry->dtype);
    const uint64_t step = std::max<uint64_t>(1, kScanPieceBytes / elem);
    for (uint64_t e = 0; e < numel; e += step)
      pieces.push_back({ref, e, std::min(step, numel - e)});
    total += ref->entry->nbytes();
  }
  if (progress) progress->BeginPhase("checking weights", total);
  RunParallel(pieces.size(), threads, [&](size_t i) {
    const Piece& p = pieces[i];
    const uint64_t elem = DTypeSize(p.ref->entry->dtype);
    const int64_t bad = FirstNonFinite(p.ref->file->Data(*p.ref->entry) + p.begin * elem, p.count,
                                       p.ref->entry->dtype);
    if (bad >= 0)
      throw Error(ErrorCode::kCorrupt,
                  plan.manifest.source_dir + ": tensor `" + p.ref->entry->name +
                      "` holds a NaN or infinite value (element " + std::to_string(p.begin + bad) +
                      "); the base weights must be finite");
    if (progress) progress->Add(p.count * elem);
  });
  if (progress) progress->EndPhase();
  return total;
}

}  // namespace lorastream::store
