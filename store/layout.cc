#include "store/layout.h"

#include <map>
#include <optional>
#include <set>

#include "common/error.h"
#include "common/finite_scan.h"
#include "common/log.h"
#include "common/tokenizer_id.h"
#include "store/convert.h"

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

}  // namespace

PackPlan PlanPack(const Checkpoint& cp, const PackOptions& options) {
  const ModelConfig& config = cp.config();
  const std::string& dir = cp.dir();
  auto fail = [&](const std::string& what) { throw Error(ErrorCode::kCorrupt, dir + ": " + what); };

  const auto block_shapes = config.BlockTensorShapes();
  const auto rest_shapes = config.RestTensorShapes();
  std::set<std::string> block_names, rest_names;
  for (const auto& [name, shape] : block_shapes) block_names.insert(name);
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
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    for (const auto& [rel, shape] : block_shapes)
      add(plan.block_sources[i], "model.layers." + std::to_string(i) + "." + rel, shape);
  for (const auto& [name, shape] : rest_shapes) add(plan.rest_sources, name, shape);
  m.dtype = options.to_bf16 ? DType::kBF16 : *source_dtype;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    m.blocks.push_back(LayoutSegment(block_shapes, "", m.dtype, options.alignment));
  m.rest = LayoutSegment(rest_shapes, "", m.dtype, options.alignment);
  if (options.scan_weights) RefuseNonFiniteWeights(plan);
  return plan;
}

void RefuseNonFiniteWeights(const PackPlan& plan) {
  auto scan = [&](const Checkpoint::Ref& ref) {
    const int64_t bad =
        FirstNonFinite(ref.file->Data(*ref.entry), ref.entry->numel(), ref.entry->dtype);
    if (bad >= 0)
      throw Error(ErrorCode::kCorrupt, plan.manifest.source_dir + ": tensor `" + ref.entry->name +
                                           "` holds a NaN or infinite value (element " +
                                           std::to_string(bad) +
                                           "); the base weights must be finite");
  };
  for (const std::vector<Checkpoint::Ref>& block : plan.block_sources)
    for (const Checkpoint::Ref& ref : block) scan(ref);
  for (const Checkpoint::Ref& ref : plan.rest_sources) scan(ref);
}

}  // namespace lorastream::store
