#include "worker/qwen_image/qwen_image_model.h"

#include <algorithm>
#include <array>
#include <cmath>

#include <ATen/ATen.h>

#include "common/base/error.h"

namespace lorastream::worker::qwen_image {

namespace {

using dit::GatedAdd;
using dit::LoraLinear;
using dit::Modulate;
using dit::RmsNorm;
using dit::Weight;

std::vector<dit::LoraAdapter::Shape> QwenLoraShapes(const QwenImageConfig& config,
                                                    const std::vector<std::string>& targets) {
  std::vector<dit::LoraAdapter::Shape> out;
  const TensorShapes shapes = QwenImageBlockShapes(config);
  for (int64_t i = 0; i < config.num_layers; ++i)
    for (const auto& t : targets)
      for (const auto& [name, shape] : shapes)
        if (name == t + ".weight")
          out.push_back({"transformer_blocks." + std::to_string(i) + "." + t, shape[0], shape[1]});
  return out;
}

std::string BlockPrefix(int64_t index) {
  return "transformer_blocks." + std::to_string(index) + ".";
}

// (shift, scale, gate) [B, 1, D] each, of the modulation's half `half` (0: attention, 1: MLP).
std::vector<at::Tensor> ModParams(const at::Tensor& mod, int half) {
  return mod.chunk(2, -1)[half].unsqueeze(1).chunk(3, -1);
}

// Whether a group's jobs run as one batch: stackable adapters, the same stream shapes, and
// the same image and control grids (so that one rotary table serves them all).
bool StackableJobs(const std::vector<const QwenImageBatch*>& batches,
                   const std::vector<const QwenImageAdapter*>& adapters,
                   const std::vector<std::vector<at::Tensor>>& streams) {
  const std::vector<const dit::LoraAdapter*> base(adapters.begin(), adapters.end());
  if (!dit::StackableAdapters(base) || !dit::SameStreamShapes(streams)) return false;
  for (const QwenImageBatch* b : batches)
    if (b->grid_h != batches[0]->grid_h || b->grid_w != batches[0]->grid_w ||
        b->control_grids != batches[0]->control_grids)
      return false;
  return true;
}

}  // namespace

QwenImageAdapter::QwenImageAdapter(const QwenImageConfig& config,
                                   const std::vector<std::string>& targets, int64_t rank,
                                   double alpha, uint64_t seed, c10::Device device)
    : dit::LoraAdapter(QwenLoraShapes(config, targets), rank, alpha, seed, device, "lora.rank") {}

LoraMap QwenImageAdapter::UnitLora(int64_t index) const { return MapUnder(BlockPrefix(index)); }

std::vector<at::Tensor> QwenImageBlockForward(int64_t index, const std::vector<at::Tensor>& streams,
                                              const NamedTensors& w, const LoraMap& lora,
                                              const QwenImageCompute& c) {
  LS_CHECK(streams.size() == 2, "a Qwen-Image block takes {img, txt}");
  const std::string p = BlockPrefix(index);
  const double s = c.lora_scale;
  const QwenImageConfig& cfg = *c.config;
  const at::Tensor& img = streams[0];
  const at::Tensor& txt = streams[1];
  const at::Tensor cond = at::silu(c.temb);
  const at::Tensor img_mod = LoraLinear(cond, w, p + "img_mod.1", lora, s);
  const at::Tensor txt_mod = LoraLinear(cond, w, p + "txt_mod.1", lora, s);
  const auto im1 = ModParams(img_mod, 0), tm1 = ModParams(txt_mod, 0);
  const at::Tensor img_x = Modulate(img, im1[0], im1[1]);
  const at::Tensor txt_x = Modulate(txt, tm1[0], tm1[1]);
  auto stream = [&](const at::Tensor& x, const std::string& q, const std::string& k,
                    const std::string& v, const std::string& q_norm, const std::string& k_norm) {
    dit::AttentionStream a;
    a.q = LoraLinear(x, w, p + q, lora, s);
    a.k = LoraLinear(x, w, p + k, lora, s);
    a.v = LoraLinear(x, w, p + v, lora, s);
    a.q_scale = Weight(w, p + q_norm + ".weight");
    a.k_scale = Weight(w, p + k_norm + ".weight");
    return a;
  };
  const at::Tensor attn = dit::JointAttention(
      {stream(txt_x, "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.norm_added_q",
              "attn.norm_added_k"),
       stream(img_x, "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k")},
      cfg.num_heads, cfg.head_dim, c.pe, c.key_mask);
  const int64_t lt = txt.size(1);
  const at::Tensor txt_attn = attn.narrow(1, 0, lt).contiguous();
  const at::Tensor img_attn = attn.narrow(1, lt, attn.size(1) - lt).contiguous();
  auto mlp = [&](const at::Tensor& x, const std::string& m) {
    return LoraLinear(at::gelu(LoraLinear(x, w, p + m + ".net.0.proj", lora, s), "tanh"), w,
                      p + m + ".net.2", lora, s);
  };
  at::Tensor img_out = GatedAdd(img, im1[2], LoraLinear(img_attn, w, p + "attn.to_out.0", lora, s));
  at::Tensor txt_out =
      GatedAdd(txt, tm1[2], LoraLinear(txt_attn, w, p + "attn.to_add_out", lora, s));
  const auto im2 = ModParams(img_mod, 1), tm2 = ModParams(txt_mod, 1);
  img_out = GatedAdd(img_out, im2[2], mlp(Modulate(img_out, im2[0], im2[1]), "img_mlp"));
  txt_out = GatedAdd(txt_out, tm2[2], mlp(Modulate(txt_out, tm2[0], tm2[1]), "txt_mlp"));
  return {img_out, txt_out};
}

at::Tensor QwenTimestepEmbedding(const at::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  const at::Tensor exponent = at::arange(half, t.options().dtype(at::kFloat)) *
                              (-std::log(10000.0)) / static_cast<double>(half);
  const at::Tensor args = t.to(at::kFloat).unsqueeze(1) * at::exp(exponent).unsqueeze(0) * 1000.0;
  return at::cat({at::cos(args), at::sin(args)}, -1);
}

at::Tensor QwenRopeTable(const QwenImageConfig& config,
                         const std::vector<std::pair<int64_t, int64_t>>& grids, int64_t txt_len,
                         c10::Device device) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // Positions per axis of every token, [txt; images]: image k (frame k, row - (H - H/2),
  // col - (W - W/2)) of its own grid; text at the largest max(H/2, W/2) + i on all three axes.
  int64_t text_start = 0;
  std::array<std::vector<at::Tensor>, 3> img_pos;
  for (size_t k = 0; k < grids.size(); ++k) {
    const auto [grid_h, grid_w] = grids[k];
    const int64_t n = grid_h * grid_w;
    text_start = std::max({text_start, grid_h / 2, grid_w / 2});
    img_pos[0].push_back(at::full({n}, static_cast<double>(k), f32));
    img_pos[1].push_back((at::arange(grid_h, f32) - static_cast<double>(grid_h - grid_h / 2))
                             .unsqueeze(1)
                             .expand({grid_h, grid_w})
                             .reshape({n}));
    img_pos[2].push_back((at::arange(grid_w, f32) - static_cast<double>(grid_w - grid_w / 2))
                             .unsqueeze(0)
                             .expand({grid_h, grid_w})
                             .reshape({n}));
  }
  const at::Tensor txt_pos = at::arange(text_start, text_start + txt_len, f32);
  std::vector<at::Tensor> angles;
  for (int i = 0; i < 3; ++i) {
    const int64_t dim = config.axes_dim[i];
    // rope_params: 1 / theta^(arange(0, dim, 2) / dim) in f32, outer with the positions.
    const at::Tensor inv =
        1.0 / at::pow(config.theta, at::arange(0, dim, 2, f32) / static_cast<double>(dim));
    std::vector<at::Tensor> pos{txt_pos};
    pos.insert(pos.end(), img_pos[i].begin(), img_pos[i].end());
    angles.push_back(at::cat(pos).unsqueeze(1) * inv.unsqueeze(0));
  }
  const at::Tensor a = at::cat(angles, 1);  // [L, head_dim / 2]
  const at::Tensor cos = at::cos(a), sin = at::sin(a);
  return at::stack({cos, -sin, sin, cos}, -1).view({1, 1, a.size(0), a.size(1), 2, 2}).to(device);
}

const at::Tensor& QwenImageModel::RopeTableFor(
    const std::vector<std::pair<int64_t, int64_t>>& grids, int64_t txt_len) {
  std::vector<int64_t> key{txt_len};
  for (const auto& [h, w] : grids) key.insert(key.end(), {h, w});
  auto it = rope_tables_.find(key);
  if (it != rope_tables_.end()) return it->second;
  if (rope_tables_.size() >= 64) rope_tables_.clear();  // a bound on many shapes
  return rope_tables_.emplace(key, QwenRopeTable(config_, grids, txt_len, device_)).first->second;
}

QwenImageModel::QwenImageModel(const QwenImageConfig& config, NamedTensors rest,
                               BlockProvider* provider, c10::Device device, c10::ScalarType dtype)
    : config_(config),
      rest_(std::move(rest)),
      provider_(provider),
      stack_jobs_(dit::StackJobsByDefault(device)),
      device_(device),
      dtype_(dtype) {
  dit::AvoidCudnnAttention(device_);
  LS_CHECK(provider_->num_blocks() == static_cast<int>(config_.num_layers),
           "the provider serves " + std::to_string(provider_->num_blocks()) +
               " units, the model has " + std::to_string(config_.num_layers) + " blocks");
}

void QwenImageModel::SetTapedUnits(std::vector<bool> taped) {
  LS_CHECK(taped.empty() || taped.size() == static_cast<size_t>(config_.num_layers),
           "a taped flag per Qwen-Image block");
  taped_ = std::move(taped);
}

at::Tensor QwenImageModel::Forward(const QwenImageBatch& batch, const QwenImageAdapter& adapter,
                                   bool checkpointed) {
  return ForwardGroup({&batch}, {&adapter}, checkpointed)[0];
}

std::vector<at::Tensor> QwenImageModel::ForwardGroup(
    const std::vector<const QwenImageBatch*>& batches,
    const std::vector<const QwenImageAdapter*>& adapters, bool checkpointed) {
  LS_CHECK(batches.size() == adapters.size() && !batches.empty(),
           "a group forward takes one adapter per batch");
  const NamedTensors& r = rest_;
  const LoraMap none;
  std::vector<QwenImageCompute> computes;
  std::vector<std::vector<at::Tensor>> streams;
  for (size_t j = 0; j < batches.size(); ++j) {
    const QwenImageBatch& b = *batches[j];
    LS_CHECK(b.img.size(1) == b.grid_h * b.grid_w,
             "a Qwen-Image batch's image tokens are its grid's");
    // The image stream: the image's tokens, then an edit batch's control images' tokens.
    std::vector<std::pair<int64_t, int64_t>> grids{{b.grid_h, b.grid_w}};
    int64_t control_tokens = 0;
    for (const auto& [h, w] : b.control_grids) {
      grids.push_back({h, w});
      control_tokens += h * w;
    }
    LS_CHECK(b.control.defined() ? b.control.size(1) == control_tokens && control_tokens > 0
                                 : control_tokens == 0,
             "a Qwen-Image-Edit batch's control tokens are its control grids'");
    const at::Tensor img = b.control.defined()
                               ? at::cat({b.img.to(dtype_), b.control.to(dtype_)}, 1)
                               : b.img.to(dtype_);
    const std::string te = "time_text_embed.timestep_embedder.";
    const at::Tensor temb =
        LoraLinear(at::silu(LoraLinear(QwenTimestepEmbedding(b.timesteps, 256).to(dtype_), r,
                                       te + "linear_1", none, 0)),
                   r, te + "linear_2", none, 0);
    QwenImageCompute c;
    c.config = &config_;
    c.temb = temb;
    c.pe = RopeTableFor(grids, b.txt.size(1));
    if (b.txt_mask.defined())
      c.key_mask = at::cat({b.txt_mask.to(at::kBool),
                            at::ones({img.size(0), img.size(1)},
                                     at::TensorOptions(b.txt_mask.device()).dtype(at::kBool))},
                           1);
    c.lora_scale = adapters[j]->scale();
    computes.push_back(c);
    const at::Tensor txt = RmsNorm(b.txt.to(dtype_), Weight(r, "txt_norm.weight"));
    streams.push_back(
        {LoraLinear(img, r, "img_in", none, 0), LoraLinear(txt, r, "txt_in", none, 0)});
  }
  // Stacked: the jobs as one batch of one compute (their rotary tables are one when their
  // grids and caption lengths are).
  const bool stacked = stack_jobs_ && StackableJobs(batches, adapters, streams);
  std::vector<QwenImageCompute> unit_computes = computes;
  if (stacked) {
    QwenImageCompute c = computes[0];
    std::vector<at::Tensor> tembs, masks;
    const bool masked = std::any_of(computes.begin(), computes.end(),
                                    [](const QwenImageCompute& x) { return x.key_mask.defined(); });
    for (size_t j = 0; j < computes.size(); ++j) {
      tembs.push_back(computes[j].temb);
      if (masked)
        masks.push_back(
            computes[j].key_mask.defined()
                ? computes[j].key_mask
                : at::ones({streams[j][0].size(0), streams[j][0].size(1) + streams[j][1].size(1)},
                           streams[j][0].options().dtype(at::kBool)));
    }
    c.temb = at::cat(tembs, 0);
    c.key_mask = masked ? at::cat(masks, 0) : at::Tensor();
    unit_computes = {c};
    streams = {dit::StackStreams(streams)};
  }
  const dit::UnitRun run{checkpointed, stacked, &taped_};
  for (int64_t u = 0; u < config_.num_layers; ++u) {
    std::vector<LoraMap> loras;
    for (const QwenImageAdapter* a : adapters) loras.push_back(a->UnitLora(u));
    const auto forward = [u](const std::vector<at::Tensor>& in, const NamedTensors& w,
                             const LoraMap& lora, const QwenImageCompute& c) {
      return QwenImageBlockForward(u, in, w, lora, c);
    };
    dit::ForwardModelUnit(*provider_, static_cast<int>(u), unit_computes, forward, std::move(loras),
                          run, &streams);
  }
  if (stacked) streams = dit::UnstackStreams(streams[0], batches.size());
  last_stacked_ = stacked;
  std::vector<at::Tensor> out;
  for (size_t j = 0; j < batches.size(); ++j) {
    const auto mod =
        LoraLinear(at::silu(computes[j].temb), r, "norm_out.linear", none, 0).chunk(2, 1);
    // The prediction of the image's tokens alone (an edit batch's control tokens follow them;
    // norm_out and proj_out act per token, so slicing first changes no value).
    const at::Tensor image = batches[j]->control.defined()
                                 ? streams[j][0].narrow(1, 0, batches[j]->img.size(1))
                                 : streams[j][0];
    const at::Tensor x = Modulate(image, mod[1].unsqueeze(1), mod[0].unsqueeze(1));
    out.push_back(LoraLinear(x, r, "proj_out", none, 0));
  }
  return out;
}

}  // namespace lorastream::worker::qwen_image
