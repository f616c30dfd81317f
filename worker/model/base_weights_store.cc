// BaseWeights over a published store: zero-copy views into its read-only shared memory.
#include <mutex>
#include <optional>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "store/attach.h"
#include "worker/model/base_weights.h"
#include "worker/model/quant_expand.h"

namespace lorastream::worker {

struct BaseWeights::Expansions {
  std::mutex mutex;
  std::vector<at::Tensor> bytes;  // [block]: its packed bytes in the store
  std::vector<SegmentInfo> layouts;
  c10::ScalarType dtype = at::kBFloat16;            // the store's
  std::vector<std::optional<BlockWeights>> blocks;  // [block]: once expanded
  std::vector<at::Tensor> buffers;                  // [block]: what they view
};

const BlockWeights& BaseWeights::block(int i) const {
  if (!expansions_) return blocks_.at(i);
  Expansions& e = *expansions_;
  std::lock_guard<std::mutex> lock(e.mutex);
  std::optional<BlockWeights>& w = e.blocks.at(i);
  // In the store's dtype, as its other tensors are (an f32 store: the bf16 weights widened).
  if (!w) w = ExpandBlock(e.bytes[i], e.layouts[i], e.dtype, &e.buffers[i]);
  return *w;
}

BaseWeights BaseWeights::FromStore(const std::string& name) {
  auto store = std::make_shared<store::AttachedStore>(store::AttachedStore::Attach(name));
  const Manifest& m = store->manifest();
  if (m.model_family() != ModelFamily::kLlm)
    throw Error(
        ErrorCode::kRefused,
        "store `" + name + "` serves " + m.family() + ", not an LLM: " +
            (m.is_flux() ? "a FLUX.1 job (one with a [flux] section) names it as model.store"
                         : "a Qwen-Image job (one with a [qwen_image] section) names it "
                           "as model.store"));
  BaseWeights b;
  b.config_ = m.config;
  b.name_or_path_ = m.source_dir.empty() ? name : m.source_dir;
  b.manifest_ = std::shared_ptr<const Manifest>(store, &store->manifest());
  b.owner_ = store;
  if (m.quant().compressed()) {
    b.expansions_ = std::make_shared<Expansions>();
    b.expansions_->layouts = m.blocks;
    b.expansions_->dtype = ScalarTypeOf(m.dtype, "the store `" + name + "`");
    b.expansions_->blocks.resize(m.blocks.size());
    b.expansions_->buffers.resize(m.blocks.size());
  }
  for (int i = 0; i < store->num_blocks(); ++i) {
    void* data = const_cast<uint8_t*>(store->block_data(i));
    at::Tensor bytes = at::from_blob(
        data, {static_cast<int64_t>(store->block_size(i))}, [keep = store](void*) {},
        at::TensorOptions().dtype(at::kByte));
    if (b.expansions_)
      b.expansions_->bytes.push_back(bytes);
    else
      b.blocks_.push_back(BlockWeightsFromBytes(bytes, m.blocks[i]));
    b.block_bytes_.push_back(store->block_data(i));
  }
  auto rest = [&](const std::string& tensor) {
    const TensorSlice* s = m.rest.Find(tensor);
    if (!s)
      throw Error(ErrorCode::kCorrupt, "store " + name + ": tensor `" + tensor + "` is missing");
    void* data = const_cast<uint8_t*>(store->rest_data() + s->offset);
    return at::from_blob(
        data, s->shape, [keep = store](void*) {},
        at::TensorOptions().dtype(ScalarTypeOf(s->dtype, tensor)));
  };
  const at::Tensor rest_bytes = at::from_blob(
      const_cast<uint8_t*>(store->rest_data()), {static_cast<int64_t>(m.rest.nbytes)},
      [keep = store](void*) {}, at::TensorOptions().dtype(at::kByte));
  // A compressed table stays compressed: the head is expanded per vocabulary slice where it is
  // computed, the embedding's batch rows on the host.
  auto table = [&](const std::string& tensor, at::Tensor* plain, PackedWeight* packed) {
    const TensorSlice* s = m.rest.Find(tensor);
    if (s != nullptr && s->quant.compressed())
      *packed = PackedWeightOf(rest_bytes, m.rest, tensor);
    else
      *plain = rest(tensor);
  };
  table("model.embed_tokens.weight", &b.rest_.embed_tokens, &b.rest_.packed_embed);
  b.rest_.norm = rest("model.norm.weight");
  if (b.config_.tie_word_embeddings) {
    b.rest_.lm_head = b.rest_.embed_tokens;
    b.rest_.packed_head = b.rest_.packed_embed;
  } else {
    table("lm_head.weight", &b.rest_.lm_head, &b.rest_.packed_head);
  }
  return b;
}

}  // namespace lorastream::worker
