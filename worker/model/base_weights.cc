#include "worker/model/base_weights.h"

#include <utility>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/job/job_spec.h"
#include "store/layout.h"

namespace lorastream::worker {

namespace {
// The dtypes weights and compute may have, in both spellings.
constexpr std::pair<DType, c10::ScalarType> kDTypes[] = {{DType::kF32, at::kFloat},
                                                         {DType::kBF16, at::kBFloat16},
                                                         {DType::kF16, at::kHalf},
                                                         {DType::kF64, at::kDouble}};
}  // namespace

c10::ScalarType ScalarTypeOf(DType dtype, const std::string& what) {
  for (const auto& [d, s] : kDTypes)
    if (d == dtype) return s;
  throw Error(ErrorCode::kUnsupported, std::string("tensor `") + what + "` has dtype " +
                                           DTypeName(dtype) +
                                           "; base weights must be F32, BF16, F16 or F64");
}

DType DTypeOf(c10::ScalarType type) {
  for (const auto& [d, s] : kDTypes)
    if (s == type) return d;
  throw Error(ErrorCode::kUnsupported,
              std::string("stream: compute dtype ") + c10::toString(type) + " is not supported");
}

RestWeights RestOnDevice(const RestWeights& rest, const ModelConfig& config, c10::Device device,
                         c10::ScalarType dtype) {
  RestWeights r = rest;
  if (rest.embed_tokens.defined()) r.embed_tokens = rest.embed_tokens.to(device, dtype);
  r.norm = rest.norm.to(device, dtype);
  if (config.tie_word_embeddings)
    r.lm_head = r.embed_tokens;
  else if (rest.lm_head.defined())
    r.lm_head = rest.lm_head.to(device, dtype);
  return r;
}

BlockWeights ConvertBlock(const BlockWeights& w, c10::Device device, c10::ScalarType dtype) {
  BlockWeights o = w;
  o.ForEachSlot([&](at::Tensor& t) {
    if (t.defined()) t = t.to(device, dtype);
  });
  return o;
}

BaseWeights BaseWeights::FromCheckpoint(const std::string& dir) {
  auto ckpt = std::make_shared<Checkpoint>(Checkpoint::Open(dir));
  // The store's own validation (as `lorastream-store serve` and `inspect`): every block of
  // config.json present, no extra block or tensor, shapes, dtypes, finite values. Mixed
  // floating dtypes are accepted, as `serve --dtype bf16` accepts them: the worker converts
  // every tensor to its compute dtype.
  store::PackOptions validation;
  validation.to_bf16 = true;
  store::PlanPack(*ckpt, validation);
  BaseWeights b;
  b.config_ = ckpt->config();
  b.name_or_path_ = dir;
  b.owner_ = ckpt;
  // A zero-copy view; the deleter holds the mapping until the last view is gone.
  auto view = [&](const std::string& name, const std::vector<int64_t>& shape) {
    Checkpoint::Ref ref = ckpt->Get(name);
    if (ref.entry->shape != shape) {
      std::string want, got;
      for (auto d : shape) want += std::to_string(d) + ",";
      for (auto d : ref.entry->shape) got += std::to_string(d) + ",";
      throw Error(ErrorCode::kCorrupt, dir + ": tensor `" + name + "` has shape [" + got +
                                           "] but config.json implies [" + want + "]");
    }
    auto type = ScalarTypeOf(ref.entry->dtype, name);
    void* data = const_cast<uint8_t*>(ref.file->Data(*ref.entry));
    return at::from_blob(
        data, shape, [keep = ckpt](void*) {}, at::TensorOptions().dtype(type));
  };
  const auto block_shapes = b.config_.BlockTensorShapes();
  for (int64_t i = 0; i < b.config_.num_hidden_layers; ++i) {
    BlockWeights w;
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    for (const auto& [name, shape] : block_shapes) {
      at::Tensor* field = BlockWeightField(w, name);
      LS_CHECK(field != nullptr, "unknown block tensor " + name);
      *field = view(prefix + name, shape);
    }
    b.blocks_.push_back(std::move(w));
  }
  const int64_t v = b.config_.vocab_size, h = b.config_.hidden_size;
  b.rest_.embed_tokens = view("model.embed_tokens.weight", {v, h});
  b.rest_.norm = view("model.norm.weight", {h});
  // Some tied checkpoints still carry lm_head.weight; transformers ignores it then.
  b.rest_.lm_head =
      b.config_.tie_word_embeddings ? b.rest_.embed_tokens : view("lm_head.weight", {v, h});
  return b;
}

BaseWeights BaseWeights::ForJob(const JobSpec& spec) {
  if (!spec.model.checkpoint.empty()) return FromCheckpoint(spec.model.checkpoint);
  return FromStore(spec.model.store);
}

}  // namespace lorastream::worker
