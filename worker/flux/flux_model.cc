#include "worker/flux/flux_model.h"

#include <cmath>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <ATen/ATen.h>

#include "common/error.h"
#include "worker/model/fused_ops.h"

namespace lorastream::worker::flux {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const at::Tensor& W(const NamedTensors& w, const std::string& name) {
  auto it = w.find(name);
  if (it == w.end() || !it->second.defined())
    throw Error(ErrorCode::kInternal, "FLUX weights: no tensor `" + name + "`");
  return it->second;
}

// base(x) + B(A x) * scale, the adapter cast to the compute dtype as under autocast.
at::Tensor Linear(const at::Tensor& x, const NamedTensors& w, const std::string& module,
                  const LoraMap& lora, double scale) {
  at::Tensor y = at::linear(x, W(w, module + ".weight"), W(w, module + ".bias"));
  auto it = lora.find(module);
  if (it == lora.end()) return y;
  const auto dtype = x.scalar_type();
  return y + at::linear(at::linear(x, it->second.a.to(dtype)), it->second.b.to(dtype)) * scale;
}

// f32 for the steps BFL computes in f32 (norms, rotary, softmax); an f64 model (the tests'
// finite differences) stays in f64.
at::ScalarType AtLeastFloat(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// On CUDA the per-head RMSNorm of q and k and the rotary embedding run as fused kernels
// (worker/model/fused_ops.h), each one autograd node, where the ATen ops below take about a
// dozen memory-bound kernels forward and more backward; they round where those ops round. On
// the CPU (and with LORASTREAM_FUSED_KERNELS=0) the ATen ops run, as the parity tests check.
bool FusedFluxOps(const at::Tensor& x) {
  return x.is_cuda() && x.scalar_type() != at::kDouble && FusedKernelsEnabled();
}

// BFL's RMSNorm (eps 1e-6) through the fused forward and backward of the LLMs' RMSNorm: its
// arithmetic, w * (x * rstd).to(dtype) with rstd in f32, is BFL's (x * rrms).to(dtype) * scale.
struct FusedRmsNorm : public torch::autograd::Function<FusedRmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& scale) {
    const at::Tensor xc = x.contiguous();
    at::Tensor rstd;
    at::Tensor y = RmsNormRstd(xc, scale, 1e-6, &rstd);
    ctx->save_for_backward({xc, rstd, scale});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    return {RmsNormBackward(grad[0].contiguous(), saved[0], saved[1], saved[2]), at::Tensor()};
  }
};

// BFL's RMSNorm over the last dim: in f32, then (x * rrms).to(dtype) * scale.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& scale) {
  if (FusedFluxOps(x) && scale.scalar_type() == x.scalar_type())
    return FusedRmsNorm::apply(x, scale);
  const at::Tensor xf = x.to(AtLeastFloat(x));
  const at::Tensor rrms = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
  return (xf * rrms).to(x.scalar_type()) * scale;
}

at::Tensor LayerNorm(const at::Tensor& x) { return at::layer_norm(x, {x.size(-1)}, {}, {}, 1e-6); }

// The rotary embedding through the fused kernel, forward and backward (the caller checked
// that it applies: FusedPairRope's conditions depend only on shapes, dtypes and the device).
struct FusedRope : public torch::autograd::Function<FusedRope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& pe) {
    at::Tensor out;
    LS_CHECK(FusedPairRope(false, x, pe, &out), "the fused rotary kernel refused its input");
    ctx->save_for_backward({pe});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor g = grad[0].stride(3) == 1 ? grad[0] : grad[0].contiguous();
    at::Tensor dx;
    LS_CHECK(FusedPairRope(true, g, ctx->get_saved_variables()[0], &dx),
             "the fused rotary kernel refused its gradient");
    return {dx, at::Tensor()};
  }
};

// apply_rope: pairs (x0, x1) rotated by pe [.., 2, 2]: out = pe[..., 0] * x0 + pe[..., 1] * x1.
at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& pe) {
  if (FusedFluxOps(x) && PairRopeFusable(x, pe)) return FusedRope::apply(x, pe);
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  sizes.push_back(1);
  sizes.push_back(2);
  const at::Tensor xf = x.to(AtLeastFloat(x)).reshape(sizes);
  const at::Tensor out = pe.select(-1, 0) * xf.select(-1, 0) + pe.select(-1, 1) * xf.select(-1, 1);
  return out.reshape(x.sizes()).to(x.scalar_type());
}

// Full (non-causal) attention over q, k, v [B, H, L, D] with RoPE; [B, L, H * D].
at::Tensor Attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& pe) {
  const at::Tensor qr = ApplyRope(q, pe), kr = ApplyRope(k, pe);
#if TORCH_VERSION_MAJOR >= 2
  at::Tensor o = at::scaled_dot_product_attention(qr, kr, v);
#else
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  at::Tensor probs = at::softmax(at::matmul(qr, kr.transpose(-2, -1)) * scale, -1, AtLeastFloat(q))
                         .to(q.scalar_type());
  at::Tensor o = at::matmul(probs, v);
#endif
  return o.permute({0, 2, 1, 3}).reshape({q.size(0), q.size(2), q.size(1) * q.size(3)});
}

// qkv [B, L, 3 H D] -> q, k, v [B, H, L, D] with q and k RMS-normed per head.
std::array<at::Tensor, 3> SplitQkv(const at::Tensor& qkv, const NamedTensors& w,
                                   const std::string& norm, const FluxConfig& c) {
  const at::Tensor t =
      qkv.view({qkv.size(0), qkv.size(1), 3, c.num_heads, c.head_dim()}).permute({2, 0, 3, 1, 4});
  const at::Tensor v = t[2];
  return {RmsNorm(t[0], W(w, norm + ".query_norm.scale")).to(v.scalar_type()),
          RmsNorm(t[1], W(w, norm + ".key_norm.scale")).to(v.scalar_type()), v};
}

// Modulation: lin(silu(vec)) [B, k H] -> k chunks [B, 1, H].
std::vector<at::Tensor> Modulation(const at::Tensor& vec, const NamedTensors& w,
                                   const std::string& module, int64_t chunks, const LoraMap& lora,
                                   double scale) {
  return Linear(at::silu(vec), w, module, lora, scale).unsqueeze(1).chunk(chunks, -1);
}

std::vector<at::Tensor> DoubleBlock(const std::string& p, const at::Tensor& img,
                                    const at::Tensor& txt, const NamedTensors& w,
                                    const LoraMap& lora, const FluxCompute& c) {
  const double s = c.lora_scale;
  const auto im = Modulation(c.vec, w, p + "img_mod.lin", 6, lora, s);
  const auto tm = Modulation(c.vec, w, p + "txt_mod.lin", 6, lora, s);
  const at::Tensor img_mod = (1 + im[1]) * LayerNorm(img) + im[0];
  const at::Tensor txt_mod = (1 + tm[1]) * LayerNorm(txt) + tm[0];
  const auto iq =
      SplitQkv(Linear(img_mod, w, p + "img_attn.qkv", lora, s), w, p + "img_attn.norm", *c.config);
  const auto tq =
      SplitQkv(Linear(txt_mod, w, p + "txt_attn.qkv", lora, s), w, p + "txt_attn.norm", *c.config);
  const at::Tensor attn = Attention(at::cat({tq[0], iq[0]}, 2), at::cat({tq[1], iq[1]}, 2),
                                    at::cat({tq[2], iq[2]}, 2), c.pe);
  const int64_t lt = txt.size(1);
  const at::Tensor txt_attn = attn.narrow(1, 0, lt);
  const at::Tensor img_attn = attn.narrow(1, lt, attn.size(1) - lt);
  auto mlp = [&](const at::Tensor& x, const std::string& m) {
    return Linear(at::gelu(Linear(x, w, m + ".0", lora, s), "tanh"), w, m + ".2", lora, s);
  };
  at::Tensor img_out = img + im[2] * Linear(img_attn, w, p + "img_attn.proj", lora, s);
  img_out = img_out + im[5] * mlp((1 + im[4]) * LayerNorm(img_out) + im[3], p + "img_mlp");
  at::Tensor txt_out = txt + tm[2] * Linear(txt_attn, w, p + "txt_attn.proj", lora, s);
  txt_out = txt_out + tm[5] * mlp((1 + tm[4]) * LayerNorm(txt_out) + tm[3], p + "txt_mlp");
  return {img_out, txt_out};
}

at::Tensor SingleBlock(const std::string& p, const at::Tensor& x, const NamedTensors& w,
                       const LoraMap& lora, const FluxCompute& c) {
  const double s = c.lora_scale;
  const int64_t h = c.config->hidden_size;
  const auto mod = Modulation(c.vec, w, p + "modulation.lin", 3, lora, s);
  const at::Tensor x_mod = (1 + mod[1]) * LayerNorm(x) + mod[0];
  const at::Tensor l1 = Linear(x_mod, w, p + "linear1", lora, s);
  const auto qkv = SplitQkv(l1.narrow(-1, 0, 3 * h).contiguous(), w, p + "norm", *c.config);
  const at::Tensor attn = Attention(qkv[0], qkv[1], qkv[2], c.pe);
  const at::Tensor mlp = at::gelu(l1.narrow(-1, 3 * h, l1.size(-1) - 3 * h), "tanh");
  return x + mod[2] * Linear(at::cat({attn, mlp}, 2), w, p + "linear2", lora, s);
}

LoraMap AdapterMap(const FluxAdapter& adapter, const std::vector<std::string>& modules) {
  LoraMap out;
  for (const auto& m : modules) out[m] = adapter.modules().at(m);
  return out;
}

// A unit as one checkpointed autograd node for every job of a group (see the header): the
// unit is acquired once for the forward of all of them and once for their recomputes. Its
// inputs are the jobs' streams one job after another, then their LoRA weights (A, B per
// module) one job after another; its outputs, each job's output streams in the same order.
struct UnitJob {
  FluxCompute compute;
  std::vector<std::string> modules;  // the job's adapted modules of this unit
  int64_t streams = 0;               // its streams (2 into a double block, 1 into singles)
};

struct UnitArgs {
  FluxUnit unit;
  int index = 0;
  BlockProvider* provider = nullptr;
  std::vector<UnitJob> jobs;
};

class UnitArgsHolder : public torch::CustomClassHolder {
 public:
  explicit UnitArgsHolder(UnitArgs a) : args(std::move(a)) {}
  UnitArgs args;
};

struct CheckpointedUnit : public torch::autograd::Function<CheckpointedUnit> {
  static variable_list forward(AutogradContext* ctx, at::TensorList streams, at::TensorList params,
                               const UnitArgs* args) {
    const NamedTensors& w = args->provider->Acquire(args->index).named;
    variable_list out;
    size_t s = 0, p = 0;
    for (const UnitJob& job : args->jobs) {
      LoraMap lora;
      for (const auto& m : job.modules) {
        lora[m] = {params[p], params[p + 1]};
        p += 2;
      }
      const std::vector<at::Tensor> in(streams.begin() + s, streams.begin() + s + job.streams);
      s += job.streams;
      for (at::Tensor& t : UnitForward(args->unit, in, w, lora, job.compute))
        out.push_back(std::move(t));
    }
    args->provider->Release(args->index);
    variable_list saved(streams.begin(), streams.end());
    for (const auto& t : params) saved.push_back(t);
    ctx->save_for_backward(saved);
    ctx->saved_data["args"] = c10::IValue::make_capsule(c10::make_intrusive<UnitArgsHolder>(*args));
    ctx->saved_data["streams"] = static_cast<int64_t>(streams.size());
    return out;
  }

  // Each job's recompute and backward in turn, within one acquisition of the unit: only one
  // job's graph of the unit exists at a time.
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto capsule = ctx->saved_data["args"].toCapsule();
    const UnitArgs& args = static_cast<UnitArgsHolder*>(capsule.get())->args;
    const int64_t n_streams = ctx->saved_data["streams"].toInt();
    variable_list saved = ctx->get_saved_variables();
    const NamedTensors& w = args.provider->Acquire(args.index).named;
    variable_list stream_grads(n_streams), param_grads;
    int64_t s = 0;
    size_t p = static_cast<size_t>(n_streams);
    for (const UnitJob& job : args.jobs) {
      at::AutoGradMode grad_on(true);
      std::vector<at::Tensor> streams, wrt;
      std::vector<int> stream_slot(job.streams, -1);
      for (int64_t i = 0; i < job.streams; ++i) {
        at::Tensor t = saved[s + i].detach();
        if (ctx->needs_input_grad(s + i)) {
          t.requires_grad_(true);
          stream_slot[i] = static_cast<int>(wrt.size());
          wrt.push_back(t);
        }
        streams.push_back(t);
      }
      LoraMap lora;
      const size_t first_param = wrt.size();
      for (const auto& m : job.modules) {
        at::Tensor a = saved[p].detach().requires_grad_(true);
        at::Tensor b = saved[p + 1].detach().requires_grad_(true);
        p += 2;
        lora[m] = {a, b};
        wrt.push_back(a);
        wrt.push_back(b);
      }
      std::vector<at::Tensor> out = UnitForward(args.unit, streams, w, lora, job.compute);
      variable_list outs, grads_in;
      for (size_t i = 0; i < out.size(); ++i) {
        const at::Tensor& g = grad_out[s + static_cast<int64_t>(i)];
        outs.push_back(out[i]);
        grads_in.push_back(g.defined() ? g : at::zeros_like(out[i]));
      }
      variable_list g = wrt.empty() ? variable_list{}
                                    : torch::autograd::grad(outs, wrt, grads_in,
                                                            /*retain_graph=*/false,
                                                            /*create_graph=*/false,
                                                            /*allow_unused=*/true);
      for (int64_t i = 0; i < job.streams; ++i)
        if (stream_slot[i] >= 0) stream_grads[s + i] = g[stream_slot[i]];
      for (size_t j = first_param; j < g.size(); ++j) param_grads.push_back(g[j]);
      s += job.streams;
    }
    args.provider->Release(args.index);
    variable_list result = std::move(stream_grads);
    result.insert(result.end(), param_grads.begin(), param_grads.end());
    result.push_back(at::Tensor());  // the UnitArgs pointer
    return result;
  }
};

}  // namespace

FluxAdapter::FluxAdapter(const FluxConfig& config, const std::vector<std::string>& targets,
                         int64_t rank, double alpha, uint64_t seed, c10::Device device)
    : rank_(rank), alpha_(alpha) {
  if (rank < 1) throw Error(ErrorCode::kRefused, "flux.rank must be at least 1");
  at::Generator gen = at::detail::createCPUGenerator(seed);
  auto add = [&](const std::string& prefix, const TensorShapes& shapes) {
    for (const auto& t : targets)
      for (const auto& [name, shape] : shapes)
        if (name == t + ".weight") {
          const int64_t in = shape[1], out = shape[0];
          const double bound = 1.0 / std::sqrt(static_cast<double>(in));
          Module m;
          m.a = at::empty({rank, in}, at::kFloat).uniform_(-bound, bound, gen).to(device);
          m.b = at::zeros({out, rank}, at::TensorOptions(device).dtype(at::kFloat));
          m.a.requires_grad_(true);
          m.b.requires_grad_(true);
          modules_[prefix + t] = m;
        }
  };
  // Blocks in order, so that the initial values depend on the seed and the module only.
  for (int64_t i = 0; i < config.depth; ++i)
    add("double_blocks." + std::to_string(i) + ".", FluxDoubleBlockShapes(config));
  for (int64_t i = 0; i < config.depth_single; ++i)
    add("single_blocks." + std::to_string(i) + ".", FluxSingleBlockShapes(config));
}

std::vector<at::Tensor> FluxAdapter::Params() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, m] : modules_) {
    out.push_back(m.a);
    out.push_back(m.b);
  }
  return out;
}

std::vector<std::string> FluxAdapter::UnitModules(const FluxUnit& unit) const {
  std::vector<std::string> out;
  for (int64_t i = unit.first; i < unit.first + unit.count; ++i) {
    const std::string prefix =
        (unit.is_double ? "double_blocks." : "single_blocks.") + std::to_string(i) + ".";
    for (auto it = modules_.lower_bound(prefix);
         it != modules_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it)
      out.push_back(it->first);
  }
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

void AvoidCudnnAttention(c10::Device device) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  if (device.is_cuda()) at::globalContext().setSDPUseCuDNN(false);
#else
  (void)device;
#endif
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

at::Tensor PackLatents(const at::Tensor& x) {
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  return x.view({b, c, h / 2, 2, w / 2, 2})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({b, h / 2 * (w / 2), c * 4});
}

at::Tensor UnpackLatents(const at::Tensor& x, int64_t h, int64_t w) {
  const int64_t b = x.size(0), c = x.size(2) / 4;
  return x.view({b, h / 2, w / 2, c, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({b, c, h, w});
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
      units_(FluxUnits(config, singles_per_unit)),
      device_(device),
      dtype_(dtype) {
  AvoidCudnnAttention(device_);
  LS_CHECK(provider_->num_blocks() == static_cast<int>(units_.size()),
           "the provider serves " + std::to_string(provider_->num_blocks()) +
               " units, the model has " + std::to_string(units_.size()));
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
    return Linear(at::silu(Linear(x, r, m + ".in_layer", none, 0)), r, m + ".out_layer", none, 0);
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
    streams.push_back({Linear(batch.img.to(dtype_), r, "img_in", none, 0),
                       Linear(batch.txt.to(dtype_), r, "txt_in", none, 0)});
  }

  for (size_t u = 0; u < units_.size(); ++u) {
    const FluxUnit& unit = units_[u];
    for (auto& s : streams)
      if (!unit.is_double && s.size() == 2) s = {at::cat({s[1], s[0]}, 1)};
    if (checkpointed) {
      UnitArgs args{unit, static_cast<int>(u), provider_, {}};
      std::vector<at::Tensor> in, params;
      for (size_t j = 0; j < batches.size(); ++j) {
        UnitJob job{computes[j], adapters[j]->UnitModules(unit),
                    static_cast<int64_t>(streams[j].size())};
        in.insert(in.end(), streams[j].begin(), streams[j].end());
        for (const auto& m : job.modules) {
          params.push_back(adapters[j]->modules().at(m).a);
          params.push_back(adapters[j]->modules().at(m).b);
        }
        args.jobs.push_back(std::move(job));
      }
      const variable_list out =
          CheckpointedUnit::apply(at::TensorList(in), at::TensorList(params), &args);
      size_t o = 0;
      for (auto& s : streams)
        for (auto& t : s) t = out[o++];
    } else {
      const NamedTensors& w = provider_->Acquire(static_cast<int>(u)).named;
      for (size_t j = 0; j < batches.size(); ++j)
        streams[j] =
            UnitForward(unit, streams[j], w,
                        AdapterMap(*adapters[j], adapters[j]->UnitModules(unit)), computes[j]);
      provider_->Release(static_cast<int>(u));
    }
  }
  std::vector<at::Tensor> out;
  for (size_t j = 0; j < batches.size(); ++j) {
    const int64_t lt = batches[j]->txt.size(1);
    const std::vector<at::Tensor>& s = streams[j];
    at::Tensor x = s.size() == 2 ? s[0] : s[0].narrow(1, lt, s[0].size(1) - lt);
    const auto mod =
        Linear(at::silu(computes[j].vec), r, "final_layer.adaLN_modulation.1", none, 0).chunk(2, 1);
    x = (1 + mod[1].unsqueeze(1)) * LayerNorm(x) + mod[0].unsqueeze(1);
    out.push_back(Linear(x, r, "final_layer.linear", none, 0));
  }
  return out;
}

}  // namespace lorastream::worker::flux
