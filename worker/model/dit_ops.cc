#include "worker/model/dit_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "worker/model/fused_ops.h"

namespace lorastream::worker::dit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// On CUDA the per-head RMSNorm (of a tensor that is not joint attention's q or k) and joint
// attention's q, k and v (JointHeads below) run as fused kernels (worker/model/fused_ops.h),
// where the ATen ops take about a dozen memory-bound kernels forward and more backward; they
// round where those ops round. On the CPU (and with LORASTREAM_FUSED_KERNELS=0) the ATen ops
// run, as the parity tests check.
bool FusedDitOps(const at::Tensor& x) {
  return x.is_cuda() && x.scalar_type() != at::kDouble && FusedKernelsEnabled();
}

// RMSNorm through the fused forward and backward of the LLMs' RMSNorm: its arithmetic,
// w * (x * rstd).to(dtype) with rstd in f32, is (x * rrms).to(dtype) * scale.
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

// JointAttention's q, k and v on CUDA as one autograd node: its inputs the distinct
// projection outputs and the streams' q and k scales (frozen: no gradient), its outputs q, k, v
// [B, H, L, D] views of [B, L, H, D] tensors (the layout flash attention reads), each part
// written by FusedHeadsForward and differentiated by FusedHeadsBackward.
struct JointHeadsPlan {
  int64_t heads = 0, head_dim = 0, length = 0;  // length: the joint sequence's
  // Per part (stream s's q, k, v at 3 s + 0, 1, 2): its input, column, first position, length.
  std::vector<int64_t> source, col, offset, rows;
};

HeadsPart PartOf(const JointHeadsPlan& plan, size_t p, at::TensorList sources,
                 at::TensorList scales) {
  HeadsPart part;
  part.src = sources[plan.source[p]];
  part.col = plan.col[p];
  if (p % 3 != 2) part.scale = scales[(p / 3) * 2 + p % 3];
  return part;
}

// Part p's positions of a [B, L, H, D] output (or of its gradient, seen as [B, H, L, D]).
at::Tensor PartView(const JointHeadsPlan& plan, size_t p, const at::Tensor& whole_bhld) {
  return whole_bhld.narrow(2, plan.offset[p], plan.rows[p]);
}

struct JointHeads : public torch::autograd::Function<JointHeads> {
  static variable_list forward(AutogradContext* ctx, at::TensorList sources, at::TensorList scales,
                               const at::Tensor& pe, const JointHeadsPlan* plan) {
    const at::Tensor& first = sources[0];
    variable_list out;
    for (int c = 0; c < 3; ++c)
      out.push_back(
          at::empty({first.size(0), plan->length, plan->heads, plan->head_dim}, first.options())
              .permute({0, 2, 1, 3}));
    for (size_t p = 0; p < plan->source.size(); ++p)
      LS_CHECK(FusedHeadsForward(PartOf(*plan, p, sources, scales), plan->heads,
                                 p % 3 == 2 ? at::Tensor() : pe, plan->offset[p],
                                 PartView(*plan, p, out[p % 3])),
               "the fused heads kernel refused its input");
    variable_list saved(sources.begin(), sources.end());
    saved.insert(saved.end(), scales.begin(), scales.end());
    saved.push_back(pe);
    ctx->save_for_backward(saved);
    ctx->saved_data["sources"] = static_cast<int64_t>(sources.size());
    ctx->saved_data["dims"] = std::vector<int64_t>{plan->heads, plan->head_dim, plan->length};
    ctx->saved_data["source"] = plan->source;
    ctx->saved_data["col"] = plan->col;
    ctx->saved_data["offset"] = plan->offset;
    ctx->saved_data["rows"] = plan->rows;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t n = ctx->saved_data["sources"].toInt();
    JointHeadsPlan plan;
    const std::vector<int64_t> dims = ctx->saved_data["dims"].toIntVector();
    plan.heads = dims[0];
    plan.head_dim = dims[1];
    plan.length = dims[2];
    plan.source = ctx->saved_data["source"].toIntVector();
    plan.col = ctx->saved_data["col"].toIntVector();
    plan.offset = ctx->saved_data["offset"].toIntVector();
    plan.rows = ctx->saved_data["rows"].toIntVector();
    const at::TensorList sources(saved.data(), n);
    const at::TensorList scales(saved.data() + n, saved.size() - n - 1);
    const at::Tensor& pe = saved.back();
    // A source whose every column is a part gets its gradient written whole; others (FLUX.1's
    // single blocks: the MLP's columns beside q, k, v) zeros elsewhere.
    variable_list d(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t covered =
          plan.heads * plan.head_dim * std::count(plan.source.begin(), plan.source.end(), i);
      d[i] =
          covered == sources[i].size(2) ? at::empty_like(sources[i]) : at::zeros_like(sources[i]);
    }
    for (size_t p = 0; p < plan.source.size(); ++p) {
      at::Tensor g = grad[p % 3];
      if (!g.defined())
        g = at::zeros({sources[0].size(0), plan.heads, plan.length, plan.head_dim},
                      sources[0].options());
      if (g.stride(3) != 1) g = g.contiguous();
      LS_CHECK(FusedHeadsBackward(PartOf(plan, p, sources, scales), plan.heads,
                                  p % 3 == 2 ? at::Tensor() : pe, plan.offset[p],
                                  PartView(plan, p, g), d[plan.source[p]]),
               "the fused heads kernel refused its gradient");
    }
    variable_list out(d.begin(), d.end());
    out.resize(saved.size() + 1);  // no gradient for the scales, pe and the plan
    return out;
  }
};

// What a checkpointed unit keeps of its jobs besides the saved tensors: their forwards and
// their modules' names (the LoRA tensors are saved variables).
struct UnitArgs {
  int index = 0;
  BlockProvider* provider = nullptr;
  std::vector<std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&,
                                                    const NamedTensors&, const LoraMap&)>>
      forwards;
  std::vector<std::vector<std::string>> modules;  // per job, in LoraMap order
  std::vector<int64_t> streams;                   // per job, its input streams
};

class UnitArgsHolder : public torch::CustomClassHolder {
 public:
  explicit UnitArgsHolder(UnitArgs a) : args(std::move(a)) {}
  UnitArgs args;
};

// A unit as one checkpointed autograd node for every job of a group: the unit is acquired
// once for the forward of all of them and once for their recomputes. Its inputs are the
// jobs' streams one job after another, then their LoRA weights (A, B per module) one job
// after another; its outputs, each job's output streams in the same order.
struct CheckpointedUnit : public torch::autograd::Function<CheckpointedUnit> {
  static variable_list forward(AutogradContext* ctx, at::TensorList streams, at::TensorList params,
                               const UnitArgs* args) {
    const NamedTensors& w = args->provider->Acquire(args->index).named;
    variable_list out;
    size_t s = 0, p = 0;
    for (size_t j = 0; j < args->forwards.size(); ++j) {
      LoraMap lora;
      for (const auto& m : args->modules[j]) {
        lora[m] = {params[p], params[p + 1]};
        p += 2;
      }
      const std::vector<at::Tensor> in(streams.begin() + s, streams.begin() + s + args->streams[j]);
      s += args->streams[j];
      for (at::Tensor& t : args->forwards[j](in, w, lora)) out.push_back(std::move(t));
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
    for (size_t j = 0; j < args.forwards.size(); ++j) {
      at::AutoGradMode grad_on(true);
      const int64_t job_streams = args.streams[j];
      std::vector<at::Tensor> streams, wrt;
      std::vector<int> stream_slot(job_streams, -1);
      for (int64_t i = 0; i < job_streams; ++i) {
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
      for (const auto& m : args.modules[j]) {
        at::Tensor a = saved[p].detach().requires_grad_(true);
        at::Tensor b = saved[p + 1].detach().requires_grad_(true);
        p += 2;
        lora[m] = {a, b};
        wrt.push_back(a);
        wrt.push_back(b);
      }
      std::vector<at::Tensor> out = args.forwards[j](streams, w, lora);
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
      for (int64_t i = 0; i < job_streams; ++i)
        if (stream_slot[i] >= 0) stream_grads[s + i] = g[stream_slot[i]];
      for (size_t k = first_param; k < g.size(); ++k) param_grads.push_back(g[k]);
      s += job_streams;
    }
    args.provider->Release(args.index);
    variable_list result = std::move(stream_grads);
    result.insert(result.end(), param_grads.begin(), param_grads.end());
    result.push_back(at::Tensor());  // the UnitArgs pointer
    return result;
  }
};

// A taped unit's backward use of the provider: its outputs pass through unchanged, and their
// gradients too, after the unit has been acquired and released (the provider's order of
// uses: forward 0..L-1, backward L-1..0, taped units included).
struct TapedUnitUse : public torch::autograd::Function<TapedUnitUse> {
  static variable_list forward(AutogradContext* ctx, at::TensorList outs, BlockProvider* provider,
                               int64_t index) {
    ctx->saved_data["provider"] = reinterpret_cast<int64_t>(provider);
    ctx->saved_data["index"] = index;
    variable_list same;
    for (const at::Tensor& t : outs) same.push_back(t.view_as(t));
    return same;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto* provider = reinterpret_cast<BlockProvider*>(ctx->saved_data["provider"].toInt());
    const int index = static_cast<int>(ctx->saved_data["index"].toInt());
    provider->Acquire(index);
    provider->Release(index);
    grad_out.push_back(at::Tensor());  // the provider
    grad_out.push_back(at::Tensor());  // the index
    return grad_out;
  }
};

}  // namespace

LoraAdapter::LoraAdapter(const std::vector<Shape>& modules, int64_t rank, double alpha,
                         uint64_t seed, c10::Device device, const std::string& rank_key)
    : rank_(rank), alpha_(alpha) {
  if (rank < 1) throw Error(ErrorCode::kRefused, rank_key + " must be at least 1");
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (const Shape& s : modules) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.in));
    LoraModule m;
    m.a = at::empty({rank, s.in}, at::kFloat).uniform_(-bound, bound, gen).to(device);
    m.b = at::zeros({s.out, rank}, at::TensorOptions(device).dtype(at::kFloat));
    m.a.requires_grad_(true);
    m.b.requires_grad_(true);
    modules_[s.name] = m;
  }
}

std::vector<at::Tensor> LoraAdapter::Params() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, m] : modules_) {
    out.push_back(m.a);
    out.push_back(m.b);
  }
  return out;
}

std::vector<std::string> LoraAdapter::ModulesUnder(const std::string& prefix) const {
  std::vector<std::string> out;
  for (auto it = modules_.lower_bound(prefix);
       it != modules_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it)
    out.push_back(it->first);
  return out;
}

LoraMap LoraAdapter::MapUnder(const std::string& prefix) const {
  LoraMap out;
  for (const auto& m : ModulesUnder(prefix)) out[m] = modules_.at(m);
  return out;
}

const at::Tensor& Weight(const NamedTensors& w, const std::string& name) {
  auto it = w.find(name);
  if (it == w.end() || !it->second.defined())
    throw Error(ErrorCode::kInternal, "unit weights: no tensor `" + name + "`");
  return it->second;
}

at::Tensor LoraLinear(const at::Tensor& x, const NamedTensors& w, const std::string& module,
                      const LoraMap& lora, double scale) {
  at::Tensor y = at::linear(x, Weight(w, module + ".weight"), Weight(w, module + ".bias"));
  auto it = lora.find(module);
  if (it == lora.end()) return y;
  const auto dtype = x.scalar_type();
  const at::Tensor a = it->second.a.to(dtype), b = it->second.b.to(dtype);
  if (a.dim() == 3) {  // stacked jobs: job k's A and B on the k-th part of x's rows
    const int64_t k = a.size(0);
    const at::Tensor u = at::bmm(x.reshape({k, -1, x.size(-1)}), a.transpose(1, 2));
    return at::baddbmm(y.reshape({k, -1, y.size(-1)}), u, b.transpose(1, 2), 1.0, scale)
        .view(y.sizes());
  }
  // The low-rank term added in the up-projection GEMM's epilogue (y + scale (x A^T) B^T): no
  // separate multiply and add passes over the output.
  const at::Tensor u = at::linear(x, a);
  return at::addmm(y.reshape({-1, y.size(-1)}), u.reshape({-1, u.size(-1)}), b.t(), 1.0, scale)
      .view(y.sizes());
}

at::ScalarType AtLeastFloat(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& scale) {
  if (FusedDitOps(x) && scale.scalar_type() == x.scalar_type())
    return FusedRmsNorm::apply(x, scale);
  const at::Tensor xf = x.to(AtLeastFloat(x));
  const at::Tensor rrms = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
  return (xf * rrms).to(x.scalar_type()) * scale;
}

at::Tensor LayerNorm(const at::Tensor& x) { return at::layer_norm(x, {x.size(-1)}, {}, {}, 1e-6); }

at::Tensor Modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale) {
  const int64_t h = x.size(-1);
  if (FusedDitOps(x) && x.dim() == 3 && x.size(0) == 1 && shift.numel() == h &&
      scale.numel() == h && shift.scalar_type() == x.scalar_type() &&
      scale.scalar_type() == x.scalar_type())
    return at::layer_norm(x, {h}, (1 + scale).reshape({h}), shift.reshape({h}), 1e-6);
  return LayerNorm(x) * (1 + scale) + shift;
}

at::Tensor GatedAdd(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) {
  if (FusedDitOps(x) && gate.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type())
    return at::addcmul(x, gate, y);
  return x + gate * y;
}

at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& pe) {
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  sizes.push_back(1);
  sizes.push_back(2);
  const at::Tensor xf = x.to(AtLeastFloat(x)).reshape(sizes);
  const at::Tensor out = pe.select(-1, 0) * xf.select(-1, 0) + pe.select(-1, 1) * xf.select(-1, 1);
  return out.reshape(x.sizes()).to(x.scalar_type());
}

namespace {

// Attention over q, k, v [B, H, L, D] (q and k rotated); returns [B, L, H D].
at::Tensor Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& key_mask) {
  const at::Tensor mask =
      key_mask.defined() ? key_mask.view({key_mask.size(0), 1, 1, key_mask.size(1)}) : key_mask;
#if TORCH_VERSION_MAJOR >= 2
  at::Tensor o = mask.defined() ? at::scaled_dot_product_attention(q, k, v, mask)
                                : at::scaled_dot_product_attention(q, k, v);
#else
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (mask.defined())
    scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor probs = at::softmax(scores, -1, AtLeastFloat(q)).to(q.scalar_type());
  at::Tensor o = at::matmul(probs, v);
#endif
  return o.permute({0, 2, 1, 3}).reshape({q.size(0), q.size(2), q.size(1) * q.size(3)});
}

// The H heads of D at column `col` of x [B, L, W], as [B, H, L, D].
at::Tensor HeadsOf(const at::Tensor& x, int64_t col, int64_t heads, int64_t head_dim) {
  return x.narrow(-1, col, heads * head_dim)
      .view({x.size(0), x.size(1), heads, head_dim})
      .permute({0, 2, 1, 3});
}

}  // namespace

bool JointHeadsFused(c10::Device device, c10::ScalarType dtype, int64_t head_dim) {
  return dtype != at::kDouble && HeadsKernelApplies(device, dtype, head_dim);
}

at::Tensor JointAttention(const std::vector<AttentionStream>& streams, int64_t heads,
                          int64_t head_dim, const at::Tensor& pe, const at::Tensor& key_mask) {
  LS_CHECK(!streams.empty() && pe.defined(), "joint attention over no stream or without RoPE");
  JointHeadsPlan plan;
  plan.heads = heads;
  plan.head_dim = head_dim;
  std::vector<at::Tensor> sources, scales;
  const at::Tensor& first = streams[0].q;
  bool fused = FusedDitOps(first);
  for (const AttentionStream& s : streams) {
    LS_CHECK(s.q_scale.defined() && s.k_scale.defined(), "joint attention: q or k without a norm");
    const int64_t rows = s.q.size(1);
    const std::array<std::pair<const at::Tensor*, int64_t>, 3> parts{
        {{&s.q, s.q_col}, {&s.k, s.k_col}, {&s.v, s.v_col}}};
    for (int c = 0; c < 3; ++c) {
      const at::Tensor& src = *parts[c].first;
      auto it = std::find_if(sources.begin(), sources.end(),
                             [&](const at::Tensor& t) { return t.is_same(src); });
      plan.source.push_back(it - sources.begin());
      if (it == sources.end()) sources.push_back(src);
      plan.col.push_back(parts[c].second);
      plan.offset.push_back(plan.length);
      plan.rows.push_back(rows);
      HeadsPart part{src, parts[c].second, c == 0 ? s.q_scale : c == 1 ? s.k_scale : at::Tensor()};
      fused = fused && src.size(0) == first.size(0) && src.size(1) == rows &&
              src.scalar_type() == first.scalar_type() && src.device() == first.device() &&
              HeadsFusable(part, heads, head_dim, c == 2 ? at::Tensor() : pe, plan.length);
    }
    scales.push_back(s.q_scale);
    scales.push_back(s.k_scale);
    plan.length += rows;
  }
  fused = fused && !pe.requires_grad() &&
          std::none_of(scales.begin(), scales.end(),
                       [](const at::Tensor& t) { return t.requires_grad(); });
  if (fused) {
    const variable_list qkv =
        JointHeads::apply(at::TensorList(sources), at::TensorList(scales), pe, &plan);
    return Attend(qkv[0], qkv[1], qkv[2], key_mask);
  }
  std::array<std::vector<at::Tensor>, 3> joint;
  for (const AttentionStream& s : streams) {
    const at::Tensor v = HeadsOf(s.v, s.v_col, heads, head_dim);
    joint[0].push_back(
        RmsNorm(HeadsOf(s.q, s.q_col, heads, head_dim), s.q_scale).to(v.scalar_type()));
    joint[1].push_back(
        RmsNorm(HeadsOf(s.k, s.k_col, heads, head_dim), s.k_scale).to(v.scalar_type()));
    joint[2].push_back(v);
  }
  auto join = [](const std::vector<at::Tensor>& t) { return t.size() == 1 ? t[0] : at::cat(t, 2); };
  return Attend(ApplyRope(join(joint[0]), pe), ApplyRope(join(joint[1]), pe), join(joint[2]),
                key_mask);
}

void AvoidCudnnAttention(c10::Device device) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  if (device.is_cuda()) at::globalContext().setSDPUseCuDNN(false);
#else
  (void)device;
#endif
}

bool StackJobsByDefault(c10::Device device) {
  const char* env = std::getenv("LORASTREAM_STACK_JOBS");
  return device.is_cuda() && !(env != nullptr && std::string(env) == "0");
}

bool StackableAdapters(const std::vector<const LoraAdapter*>& adapters) {
  if (adapters.size() < 2) return false;
  const LoraMap& first = adapters[0]->modules();
  for (const LoraAdapter* a : adapters) {
    if (a->scale() != adapters[0]->scale() || a->modules().size() != first.size()) return false;
    for (const auto& [name, m] : a->modules()) {
      auto it = first.find(name);
      if (it == first.end() || !m.a.sizes().equals(it->second.a.sizes()) ||
          !m.b.sizes().equals(it->second.b.sizes()))
        return false;
    }
  }
  return true;
}

LoraMap StackLoras(const std::vector<LoraMap>& maps) {
  LoraMap out;
  for (const auto& [name, m] : maps.at(0)) {
    std::vector<at::Tensor> as, bs;
    for (const LoraMap& map : maps) {
      const LoraModule& mj = map.at(name);
      as.push_back(mj.a);
      bs.push_back(mj.b);
    }
    out[name] = {at::stack(as), at::stack(bs)};
  }
  return out;
}

bool SameStreamShapes(const std::vector<std::vector<at::Tensor>>& streams) {
  for (const auto& s : streams) {
    if (s.size() != streams[0].size()) return false;
    for (size_t i = 0; i < s.size(); ++i)
      if (!s[i].sizes().equals(streams[0][i].sizes())) return false;
  }
  return true;
}

std::vector<at::Tensor> StackStreams(const std::vector<std::vector<at::Tensor>>& streams) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < streams.at(0).size(); ++i) {
    std::vector<at::Tensor> parts;
    for (const auto& s : streams) parts.push_back(s[i]);
    out.push_back(at::cat(parts, 0));
  }
  return out;
}

std::vector<std::vector<at::Tensor>> UnstackStreams(const std::vector<at::Tensor>& stacked,
                                                    size_t jobs) {
  std::vector<std::vector<at::Tensor>> out(jobs);
  for (const at::Tensor& t : stacked) {
    const std::vector<at::Tensor> parts = t.chunk(static_cast<int64_t>(jobs), 0);
    LS_CHECK(parts.size() == jobs, "stacked streams split into their jobs' equal parts");
    for (size_t j = 0; j < jobs; ++j) out[j].push_back(parts[j]);
  }
  return out;
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

void ForwardUnit(BlockProvider& provider, int index, const std::vector<UnitJob>& jobs,
                 std::vector<std::vector<at::Tensor>>* streams, bool checkpointed) {
  LS_CHECK(streams->size() == jobs.size(), "a unit's forward takes one job per stream set");
  if (!checkpointed) {
    const NamedTensors& w = provider.Acquire(index).named;
    for (size_t j = 0; j < jobs.size(); ++j)
      (*streams)[j] = jobs[j].forward((*streams)[j], w, jobs[j].lora);
    provider.Release(index);
    return;
  }
  UnitArgs args;
  args.index = index;
  args.provider = &provider;
  std::vector<at::Tensor> in, params;
  for (size_t j = 0; j < jobs.size(); ++j) {
    args.forwards.push_back(jobs[j].forward);
    args.streams.push_back(static_cast<int64_t>((*streams)[j].size()));
    in.insert(in.end(), (*streams)[j].begin(), (*streams)[j].end());
    std::vector<std::string> names;
    for (const auto& [m, lora] : jobs[j].lora) {
      names.push_back(m);
      params.push_back(lora.a);
      params.push_back(lora.b);
    }
    args.modules.push_back(std::move(names));
  }
  const variable_list out =
      CheckpointedUnit::apply(at::TensorList(in), at::TensorList(params), &args);
  size_t o = 0;
  for (auto& s : *streams)
    for (auto& t : s) t = out[o++];
}

void ForwardUnitTaped(BlockProvider& provider, int index, const std::vector<UnitJob>& jobs,
                      std::vector<std::vector<at::Tensor>>* streams) {
  ForwardUnit(provider, index, jobs, streams, /*checkpointed=*/false);
  std::vector<at::Tensor> outs;
  for (const auto& s : *streams) outs.insert(outs.end(), s.begin(), s.end());
  const variable_list passed = TapedUnitUse::apply(at::TensorList(outs), &provider, index);
  size_t o = 0;
  for (auto& s : *streams)
    for (auto& t : s) t = passed[o++];
}

void ForwardModelUnit(BlockProvider& provider, int index, std::vector<UnitJobForward> forwards,
                      std::vector<LoraMap> loras, const UnitRun& run,
                      std::vector<std::vector<at::Tensor>>* streams) {
  if (run.stacked) loras = {StackLoras(loras)};
  LS_CHECK(forwards.size() == loras.size(), "a LoRA per job of a unit");
  std::vector<UnitJob> jobs;
  for (size_t j = 0; j < forwards.size(); ++j) {
    UnitJob job;
    job.forward = std::move(forwards[j]);
    job.lora = std::move(loras[j]);
    jobs.push_back(std::move(job));
  }
  const size_t u = static_cast<size_t>(index);
  if (run.checkpointed && run.taped_units && u < run.taped_units->size() && (*run.taped_units)[u])
    ForwardUnitTaped(provider, index, jobs, streams);
  else
    ForwardUnit(provider, index, jobs, streams, run.checkpointed);
}

}  // namespace lorastream::worker::dit
