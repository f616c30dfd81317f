#include "worker/model/model.h"

#include <algorithm>
#include <cmath>

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/data.h"
#include "worker/model/fused_ops.h"
#include "worker/model/head_rows.h"

namespace lorastream::worker {

uint64_t MixSeed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  return mix(mix(mix(mix(seed) ^ a) ^ b) ^ c);
}

at::Tensor RotaryInvFreq(const ModelConfig& c) {
  const int64_t dim = c.head_dim;
  // transformers: 1.0 / (base ** (arange(0, dim, 2, int64).float() / dim)), in f32.
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  at::Tensor inv_freq = at::reciprocal(at::pow(c.rope_theta, exponent)) * 1.0;
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == "linear") {
    inv_freq = inv_freq / rs.factor;
  } else if (rs.type == "llama3") {
    // transformers' _compute_llama3_parameters.
    const double old_len = static_cast<double>(rs.original_max_position_embeddings);
    const double low_freq_wavelen = old_len / rs.low_freq_factor;
    const double high_freq_wavelen = old_len / rs.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor llama = at::where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq);
    at::Tensor smooth =
        (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * llama / rs.factor + smooth * llama;
    at::Tensor medium = at::logical_not(wavelen < high_freq_wavelen)
                            .logical_and(at::logical_not(wavelen > low_freq_wavelen));
    inv_freq = at::where(medium, smoothed, llama);
  }
  return inv_freq;
}

RotaryTables BuildRotary(const ModelConfig& c, int64_t seq_len, c10::Device device,
                         c10::ScalarType dtype) {
  at::Tensor inv_freq = RotaryInvFreq(c).to(device);
  at::Tensor pos =
      at::arange(seq_len, at::TensorOptions().dtype(at::kLong).device(device)).to(at::kFloat);
  at::Tensor freqs = at::outer(pos, inv_freq);  // [S, D/2], each one product, as the matmul
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return RotaryTables{emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormRstd(x, weight, eps, nullptr);
}

CausalLm::CausalLm(const ModelConfig& config, RestWeights rest, BlockProvider* provider,
                   c10::Device device, c10::ScalarType dtype, HeadProvider* head)
    : config_(config),
      rest_(std::move(rest)),
      provider_(provider),
      head_(head),
      device_(device),
      dtype_(dtype) {
  LS_CHECK(provider_ != nullptr, "CausalLm needs a block provider");
  if (head_ == nullptr) {
    LS_CHECK(rest_.lm_head.defined() || rest_.packed_head.defined(),
             "CausalLm needs rest.lm_head or a head provider");
    own_head_ = MakeResidentHead(rest_, device_, dtype_);
    head_ = own_head_.get();
  }
  LS_CHECK(provider_->num_blocks() == config_.num_hidden_layers,
           "the provider's block count differs from num_hidden_layers");
}

const RotaryTables& CausalLm::Rotary(int64_t seq_len) {
  auto it = rope_.find(seq_len);
  if (it == rope_.end())
    it = rope_.emplace(seq_len, BuildRotary(config_, seq_len, device_, dtype_)).first;
  return it->second;
}

at::Tensor CausalLm::Hidden(const at::Tensor& ids, const LoraAdapter& adapter, bool training,
                            bool checkpointed, uint64_t dropout_seed) {
  return HiddenFromEmbeddings(Embed(ids), adapter, training, checkpointed, dropout_seed);
}

namespace {

// The LM head held once for every job of a group: the jobs' heads run one after another
// between one Acquire and one Release of the model's head (a streamed head is copied once).
class GroupHead : public HeadProvider {
 public:
  GroupHead(HeadProvider& head, size_t uses) : head_(head), uses_(uses) {}
  ~GroupHead() override {
    if (!acquired_) return;
    try {
      head_.Release();
    } catch (const std::exception& e) {
      LS_LOG_WARN("LM head: release failed: {}", e.what());
    }
  }
  GroupHead(const GroupHead&) = delete;
  GroupHead& operator=(const GroupHead&) = delete;
  void Acquire() override {
    if (!acquired_) head_.Acquire();
    acquired_ = true;
  }
  at::Tensor Slice(int64_t i) override { return head_.Slice(i); }
  int64_t num_slices() const override { return head_.num_slices(); }
  int64_t slice_rows() const override { return head_.slice_rows(); }
  int64_t vocab() const override { return head_.vocab(); }
  void Release() override {
    if (++released_ < uses_) return;
    acquired_ = false;
    head_.Release();
  }
  bool streamed() const override { return head_.streamed(); }

 private:
  HeadProvider& head_;
  size_t uses_;
  size_t released_ = 0;
  bool acquired_ = false;
};

}  // namespace

std::vector<at::Tensor> CausalLm::GroupHidden(const std::vector<at::Tensor>& embeddings,
                                              const std::vector<const LoraAdapter*>& adapters,
                                              bool training, bool checkpointed,
                                              const std::vector<uint64_t>& dropout_seeds) {
  std::vector<GroupBlockInput> in(embeddings.size());
  for (size_t j = 0; j < embeddings.size(); ++j) {
    const at::Tensor& e = embeddings[j];
    if (e.dim() != 3 || e.size(2) != config_.hidden_size || e.device() != device_)
      throw Error(ErrorCode::kInvalidArgument,
                  "embeddings must be [batch, seq, hidden_size] on the model's device");
    const LoraSettings& settings = adapters[j]->settings();
    in[j].x = e;
    in[j].adapter = adapters[j];
    in[j].compute.config = &config_;
    in[j].compute.rope = &Rotary(e.size(1));
    in[j].compute.lora_scale = settings.Scale();
    in[j].compute.dropout = settings.dropout;
    in[j].compute.training = training;
  }
  // The provider's last taped blocks keep their activations when there is a backward to keep
  // them for.
  const int first_taped =
      training && c10::GradMode::is_enabled()
          ? config_.num_hidden_layers - std::clamp(provider_->taped_blocks(), 0,
                                                   static_cast<int>(config_.num_hidden_layers))
          : config_.num_hidden_layers;
  for (int i = 0; i < config_.num_hidden_layers; ++i) {
    for (size_t j = 0; j < in.size(); ++j)
      in[j].compute.dropout_seed = MixSeed(dropout_seeds[j], static_cast<uint64_t>(i));
    if (checkpointed) {
      const std::vector<at::Tensor> hs =
          CheckpointedGroupBlockForward(in, i, *provider_, /*keep_tape=*/i >= first_taped);
      for (size_t j = 0; j < in.size(); ++j) in[j].x = hs[j];
    } else {
      const BlockWeights& w = provider_->Acquire(i);
      for (GroupBlockInput& j : in) j.x = BlockForward(j.x, w, j.adapter->block(i), j.compute);
      provider_->Release(i);
    }
  }
  std::vector<at::Tensor> out;
  for (const GroupBlockInput& j : in) out.push_back(j.x);
  return out;
}

at::Tensor CausalLm::HiddenFromEmbeddings(const at::Tensor& embeddings, const LoraAdapter& adapter,
                                          bool training, bool checkpointed, uint64_t dropout_seed) {
  return GroupHidden({embeddings}, {&adapter}, training, checkpointed, {dropout_seed})[0];
}

at::Tensor CausalLm::Embed(const at::Tensor& ids) {
  if (ids.dim() != 2) throw Error(ErrorCode::kInvalidArgument, "input ids must be [batch, seq]");
  if (ids.size(1) > config_.max_position_embeddings)
    throw Error(ErrorCode::kRefused, "sequence of " + std::to_string(ids.size(1)) +
                                         " tokens is longer than max_position_embeddings");
  // A compressed table's rows are expanded on the host (only the batch's).
  at::Tensor rows =
      rest_.packed_embed.defined() && !rest_.embed_tokens.defined()
          ? GatherPackedRows(rest_.packed_embed, ids).to(dtype_)
          : at::embedding(rest_.embed_tokens, ids.to(rest_.embed_tokens.device())).to(dtype_);
  if (rows.device() == device_) return rows;
  // Only the batch's rows cross; from pinned memory the copy is asynchronous and at full
  // speed (the caching host allocator keeps the buffer until the copy has completed).
  if (device_.is_cuda()) rows = rows.pin_memory();
  return rows.to(device_, dtype_, /*non_blocking=*/true);
}

at::Tensor CausalLm::Logits(const at::Tensor& hidden) {
  head_->Acquire();
  at::Tensor logits =
      at::linear(RmsNorm(hidden, rest_.norm, config_.rms_norm_eps), WholeHead(*head_));
  head_->Release();
  return logits;
}

int64_t CausalLm::head_chunk_rows(int64_t tokens) const {
  if (head_chunk_rows_ > 0) return head_chunk_rows_;
  return DefaultHeadChunkRows(config_, tokens, device_.is_cuda(), dtype_);
}

int64_t DefaultHeadChunkRows(const ModelConfig& config, int64_t tokens, bool cuda,
                             c10::ScalarType dtype) {
  return HeadChunkRows(tokens, config.vocab_size, config.hidden_size, kDefaultHeadChunkBytes,
                       FusedCrossEntropyApplies(cuda, dtype));
}

at::Tensor CausalLm::HeadLossSum(const at::Tensor& hidden, const at::Tensor& targets) {
  return ChunkedHeadLossSum(hidden, targets, rest_.norm, config_.rms_norm_eps, *head_,
                            head_chunk_rows(targets.numel()));
}

at::Tensor CausalLm::TrainMicroBatch(const at::Tensor& embeddings, const at::Tensor& targets,
                                     const LoraAdapter& adapter, const at::Tensor& loss_divisor,
                                     uint64_t dropout_seed) {
  return TrainGroupMicroBatch(
      {GroupMicroBatch{embeddings, targets, loss_divisor, &adapter, dropout_seed}})[0];
}

std::vector<at::Tensor> CausalLm::TrainGroupMicroBatch(const std::vector<GroupMicroBatch>& jobs) {
  std::vector<at::Tensor> embeddings;
  std::vector<const LoraAdapter*> adapters;
  std::vector<uint64_t> seeds;
  for (const GroupMicroBatch& j : jobs) {
    embeddings.push_back(j.embeddings);
    adapters.push_back(j.adapter);
    seeds.push_back(j.dropout_seed);
  }
  const std::vector<at::Tensor> hidden =
      GroupHidden(embeddings, adapters, /*training=*/true, /*checkpointed=*/true, seeds);
  std::vector<at::Tensor> losses;
  {
    GroupHead head(*head_, jobs.size());
    for (size_t j = 0; j < jobs.size(); ++j)
      losses.push_back(ChunkedHeadLossSum(hidden[j], jobs[j].targets, rest_.norm,
                                          config_.rms_norm_eps, head,
                                          head_chunk_rows(jobs[j].targets.numel())) /
                       jobs[j].loss_divisor);
  }
  torch::autograd::backward(losses);
  return losses;
}

at::Tensor CausalLm::LossDivisor(int64_t targets) const {
  return at::full({}, static_cast<double>(std::max<int64_t>(1, targets)),
                  at::TensorOptions().dtype(at::kFloat).device(device_));
}

at::Tensor CausalLm::LossSum(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t vocab = logits.size(-1);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, vocab}), targets.reshape({-1}),
                                /*weight=*/{}, at::Reduction::Sum, /*ignore_index=*/kIgnoreIndex,
                                /*label_smoothing=*/0.0);
}

}  // namespace lorastream::worker
