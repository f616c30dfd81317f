#include "worker/flux/flux_model.h"

#include <cmath>

#include <ATen/ATen.h>

#include "common/base/error.h"

namespace lorastream::worker::flux {

namespace {

using dit::GatedAdd;
using dit::LoraLinear;
using dit::Modulate;
using dit::Weight;

// A stream of joint attention whose q, k and v are the three thirds of qkv's first 3 H D
// columns, q and k RMS-normed per head with `norm`'s scales.
dit::AttentionStream QkvStream(const at::Tensor& qkv, const NamedTensors& w,
                               const std::string& norm, const FluxConfig& c) {
  dit::AttentionStream s;
  s.q = s.k = s.v = qkv;
  s.k_col = c.hidden_size;
  s.v_col = 2 * c.hidden_size;
  s.q_scale = Weight(w, norm + ".query_norm.scale");
  s.k_scale = Weight(w, norm + ".key_norm.scale");
  return s;
}

at::Tensor FluxAttention(const std::vector<dit::AttentionStream>& streams, const FluxCompute& c) {
  return dit::JointAttention(streams, c.config->num_heads, c.config->head_dim(), c.pe);
}

// Modulation: lin(silu(vec)) [B, k H] -> k chunks [B, 1, H].
std::vector<at::Tensor> Modulation(const at::Tensor& vec, const NamedTensors& w,
                                   const std::string& module, int64_t chunks, const LoraMap& lora,
                                   double scale) {
  return LoraLinear(at::silu(vec), w, module, lora, scale).unsqueeze(1).chunk(chunks, -1);
}

std::vector<at::Tensor> DoubleBlock(const std::string& p, const at::Tensor& img,
                                    const at::Tensor& txt, const NamedTensors& w,
                                    const LoraMap& lora, const FluxCompute& c) {
  const double s = c.lora_scale;
  const auto im = Modulation(c.vec, w, p + "img_mod.lin", 6, lora, s);
  const auto tm = Modulation(c.vec, w, p + "txt_mod.lin", 6, lora, s);
  const at::Tensor img_mod = Modulate(img, im[0], im[1]);
  const at::Tensor txt_mod = Modulate(txt, tm[0], tm[1]);
  const at::Tensor attn =
      FluxAttention({QkvStream(LoraLinear(txt_mod, w, p + "txt_attn.qkv", lora, s), w,
                               p + "txt_attn.norm", *c.config),
                     QkvStream(LoraLinear(img_mod, w, p + "img_attn.qkv", lora, s), w,
                               p + "img_attn.norm", *c.config)},
                    c);
  const int64_t lt = txt.size(1);
  const at::Tensor txt_attn = attn.narrow(1, 0, lt);
  const at::Tensor img_attn = attn.narrow(1, lt, attn.size(1) - lt);
  auto mlp = [&](const at::Tensor& x, const std::string& m) {
    return LoraLinear(at::gelu(LoraLinear(x, w, m + ".0", lora, s), "tanh"), w, m + ".2", lora, s);
  };
  at::Tensor img_out = GatedAdd(img, im[2], LoraLinear(img_attn, w, p + "img_attn.proj", lora, s));
  img_out = GatedAdd(img_out, im[5], mlp(Modulate(img_out, im[3], im[4]), p + "img_mlp"));
  at::Tensor txt_out = GatedAdd(txt, tm[2], LoraLinear(txt_attn, w, p + "txt_attn.proj", lora, s));
  txt_out = GatedAdd(txt_out, tm[5], mlp(Modulate(txt_out, tm[3], tm[4]), p + "txt_mlp"));
  return {img_out, txt_out};
}

at::Tensor SingleBlock(const std::string& p, const at::Tensor& x, const NamedTensors& w,
                       const LoraMap& lora, const FluxCompute& c) {
  const double s = c.lora_scale;
  const int64_t h = c.config->hidden_size;
  const auto mod = Modulation(c.vec, w, p + "modulation.lin", 3, lora, s);
  const at::Tensor x_mod = Modulate(x, mod[0], mod[1]);
  const at::Tensor l1 = LoraLinear(x_mod, w, p + "linear1", lora, s);
  const at::Tensor attn = FluxAttention({QkvStream(l1, w, p + "norm", *c.config)}, c);
  const at::Tensor mlp = at::gelu(l1.narrow(-1, 3 * h, l1.size(-1) - 3 * h), "tanh");
  return GatedAdd(x, mod[2], LoraLinear(at::cat({attn, mlp}, 2), w, p + "linear2", lora, s));
}

}  // namespace

namespace {

// The adapted modules with their shapes, block by block, each block's in `targets` order.
std::vector<dit::LoraAdapter::Shape> FluxLoraShapes(const FluxConfig& config,
                                                    const std::vector<std::string>& targets) {
  std::vector<dit::LoraAdapter::Shape> out;
  auto add = [&](const std::string& prefix, const TensorShapes& shapes) {
    for (const auto& t : targets)
      for (const auto& [name, shape] : shapes)
        if (name == t + ".weight") out.push_back({prefix + t, shape[0], shape[1]});
  };
  for (int64_t i = 0; i < config.depth; ++i)
    add("double_blocks." + std::to_string(i) + ".", FluxDoubleBlockShapes(config));
  for (int64_t i = 0; i < config.depth_single; ++i)
    add("single_blocks." + std::to_string(i) + ".", FluxSingleBlockShapes(config));
  return out;
}

}  // namespace

FluxAdapter::FluxAdapter(const FluxConfig& config, const std::vector<std::string>& targets,
                         int64_t rank, double alpha, uint64_t seed, c10::Device device,
                         const std::string& rank_key)
    : dit::LoraAdapter(FluxLoraShapes(config, targets), rank, alpha, seed, device, rank_key) {}

std::vector<std::string> FluxAdapter::UnitModules(const FluxUnit& unit) const {
  std::vector<std::string> out;
  for (int64_t i = unit.first; i < unit.first + unit.count; ++i)
    for (auto& m : ModulesUnder((unit.is_double ? "double_blocks." : "single_blocks.") +
                                std::to_string(i) + "."))
      out.push_back(std::move(m));
  return out;
}

std::vector<at::Tensor> UnitForward(const FluxUnit& unit, const std::vector<at::Tensor>& streams,
                                    const NamedTensors& w, const LoraMap& lora,
                                    const FluxCompute& c) {
  if (unit.is_double) {
    LS_CHECK(streams.size() == 2, "a double block takes {img, txt}");
    return DoubleBlock("double_blocks." + std::to_string(unit.first) + ".", streams[0], streams[1],
                       w, lora, c);
  }
  LS_CHECK(streams.size() == 1, "single blocks take {x}");
  at::Tensor x = streams[0];
  for (int64_t i = unit.first; i < unit.first + unit.count; ++i)
    x = SingleBlock("single_blocks." + std::to_string(i) + ".", x, w, lora, c);
  return {x};
}

at::Tensor TimestepEmbedding(const at::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  const at::Tensor freqs =
      at::exp(-std::log(10000.0) * at::arange(half, t.options().dtype(at::kFloat)) /
              static_cast<double>(half));
  const at::Tensor args = (t.to(at::kFloat) * 1000.0).unsqueeze(1) * freqs.unsqueeze(0);
  return at::cat({at::cos(args), at::sin(args)}, -1);
}

at::Tensor RopeTable(const at::Tensor& ids, const FluxConfig& config) {
  std::vector<at::Tensor> axes;
  for (int i = 0; i < 3; ++i) {
    const int64_t dim = config.axes_dim[i];
    // rope(): omega = 1 / theta^(arange(0, dim, 2) / dim) in f64, then the angles.
    const at::Tensor scale =
        at::arange(0, dim, 2, ids.options().dtype(at::kDouble)) / static_cast<double>(dim);
    const at::Tensor omega = 1.0 / at::pow(config.theta, scale);
    const at::Tensor out = ids.select(-1, i).to(at::kDouble).unsqueeze(-1) * omega;  // [B, L, d/2]
    const at::Tensor cos = at::cos(out), sin = at::sin(out);
    axes.push_back(
        at::stack({cos, -sin, sin, cos}, -1).view({out.size(0), out.size(1), dim / 2, 2, 2}));
  }
  return at::cat(axes, -3).unsqueeze(1).to(at::kFloat);
}

at::Tensor ImageIds(int64_t batch, int64_t height, int64_t width, c10::Device device) {
  const auto opts = at::TensorOptions(device).dtype(at::kFloat);
  at::Tensor ids = at::zeros({height / 2, width / 2, 3}, opts);
  ids.select(-1, 1).copy_(
      at::arange(height / 2, opts).unsqueeze(1).expand({height / 2, width / 2}));
  ids.select(-1, 2).copy_(at::arange(width / 2, opts).unsqueeze(0).expand({height / 2, width / 2}));
  return ids.reshape({1, height / 2 * (width / 2), 3}).expand({batch, -1, -1}).contiguous();
}

FluxModel::FluxModel(const FluxConfig& config, NamedTensors rest, BlockProvider* provider,
                     int64_t singles_per_unit, c10::Device device, c10::ScalarType dtype)
    : config_(config),
      rest_(std::move(rest)),
      provider_(provider),
      stack_jobs_(dit::StackJobsByDefault(device)),
      units_(FluxUnits(config, singles_per_unit)),
      device_(device),
      dtype_(dtype) {
  AvoidCudnnAttention(device_);
  LS_CHECK(provider_->num_blocks() == static_cast<int>(units_.size()),
           "the provider serves " + std::to_string(provider_->num_blocks()) +
               " units, the model has " + std::to_string(units_.size()));
}

void FluxModel::SetTapedUnits(std::vector<bool> taped) {
  LS_CHECK(taped.empty() || taped.size() == units_.size(), "a taped flag per FLUX unit");
  taped_ = std::move(taped);
}

at::Tensor FluxModel::Forward(const FluxBatch& batch, const FluxAdapter& adapter,
                              bool checkpointed) {
  return ForwardGroup({&batch}, {&adapter}, checkpointed)[0];
}

std::vector<at::Tensor> FluxModel::ForwardGroup(const std::vector<const FluxBatch*>& batches,
                                                const std::vector<const FluxAdapter*>& adapters,
                                                bool checkpointed) {
  LS_CHECK(batches.size() == adapters.size() && !batches.empty(),
           "a group forward takes one adapter per batch");
  const NamedTensors& r = rest_;
  const LoraMap none;
  auto mlp_embedder = [&](const at::Tensor& x, const std::string& m) {
    return LoraLinear(at::silu(LoraLinear(x, r, m + ".in_layer", none, 0)), r, m + ".out_layer",
                      none, 0);
  };
  // Per job: its conditioning, rotary table and input streams, as a model of its own.
  std::vector<FluxCompute> computes;
  std::vector<std::vector<at::Tensor>> streams;
  for (size_t j = 0; j < batches.size(); ++j) {
    const FluxBatch& batch = *batches[j];
    at::Tensor vec = mlp_embedder(TimestepEmbedding(batch.timesteps, 256).to(dtype_), "time_in");
    if (config_.guidance_embed)
      vec = vec + mlp_embedder(TimestepEmbedding(batch.guidance, 256).to(dtype_), "guidance_in");
    vec = vec + mlp_embedder(batch.y.to(dtype_), "vector_in");
    FluxCompute c;
    c.config = &config_;
    c.vec = vec;
    c.pe = RopeTable(at::cat({batch.txt_ids, batch.img_ids}, 1), config_);
    c.lora_scale = adapters[j]->scale();
    computes.push_back(c);
    streams.push_back({LoraLinear(batch.img.to(dtype_), r, "img_in", none, 0),
                       LoraLinear(batch.txt.to(dtype_), r, "txt_in", none, 0)});
  }

  // Stacked: the jobs as one batch of one compute (conditioning and rotary tables are per
  // sample, concatenated).
  const std::vector<const dit::LoraAdapter*> lora_adapters(adapters.begin(), adapters.end());
  const bool stacked =
      stack_jobs_ && dit::StackableAdapters(lora_adapters) && dit::SameStreamShapes(streams);
  std::vector<FluxCompute> unit_computes = computes;
  if (stacked) {
    FluxCompute c = computes[0];
    std::vector<at::Tensor> vecs, pes;
    const int64_t batch = streams[0][0].size(0);
    for (const FluxCompute& cj : computes) {
      vecs.push_back(cj.vec);
      std::vector<int64_t> sizes = cj.pe.sizes().vec();
      sizes[0] = batch;  // a table shared by the batch, one per sample
      pes.push_back(cj.pe.expand(sizes));
    }
    c.vec = at::cat(vecs, 0);
    c.pe = at::cat(pes, 0);
    unit_computes = {c};
    streams = {dit::StackStreams(streams)};
  }
  const dit::UnitRun run{checkpointed, stacked, &taped_};
  for (size_t u = 0; u < units_.size(); ++u) {
    const FluxUnit& unit = units_[u];
    for (auto& s : streams)
      if (!unit.is_double && s.size() == 2) s = {at::cat({s[1], s[0]}, 1)};
    std::vector<LoraMap> loras(adapters.size());
    for (size_t j = 0; j < adapters.size(); ++j)
      for (const auto& m : adapters[j]->UnitModules(unit))
        loras[j][m] = adapters[j]->modules().at(m);
    const auto forward = [unit](const std::vector<at::Tensor>& in, const NamedTensors& w,
                                const LoraMap& lora,
                                const FluxCompute& c) { return UnitForward(unit, in, w, lora, c); };
    dit::ForwardModelUnit(*provider_, static_cast<int>(u), unit_computes, forward, std::move(loras),
                          run, &streams);
  }
  if (stacked) streams = dit::UnstackStreams(streams[0], batches.size());
  last_stacked_ = stacked;
  std::vector<at::Tensor> out;
  for (size_t j = 0; j < batches.size(); ++j) {
    const int64_t lt = batches[j]->txt.size(1);
    const std::vector<at::Tensor>& s = streams[j];
    at::Tensor x = s.size() == 2 ? s[0] : s[0].narrow(1, lt, s[0].size(1) - lt);
    const auto mod =
        LoraLinear(at::silu(computes[j].vec), r, "final_layer.adaLN_modulation.1", none, 0)
            .chunk(2, 1);
    x = Modulate(x, mod[0].unsqueeze(1), mod[1].unsqueeze(1));
    out.push_back(LoraLinear(x, r, "final_layer.linear", none, 0));
  }
  return out;
}

}  // namespace lorastream::worker::flux
