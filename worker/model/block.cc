#include "worker/model/block.h"

#include <mutex>
#include <vector>

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/error.h"
#include "worker/model/fused_ops.h"
#include "worker/model/torch_compat.h"

namespace lorastream::worker {

namespace {

// One base projection of a block: which adapter target, its weight and optional bias.
struct Projection {
  int target;
  const at::Tensor* weight;
  const at::Tensor* bias;
};

bool DropoutActive(const BlockCompute& c) { return c.training && c.dropout > 0; }

// The projection groups: the projections reading one input.
enum Group { kQkvGroup = 0, kOGroup, kGateUpGroup, kDownGroup };

// The projections of `ps` that carry an adapter, as indices into `ps`.
template <size_t N>
std::vector<size_t> Adapted(const std::array<Projection, N>& ps, const LoraBlock& lora) {
  std::vector<size_t> out;
  for (size_t i = 0; i < N; ++i)
    if (lora.a[ps[i].target].defined()) out.push_back(i);
  return out;
}

// The A matrices of the adapted projections stacked [k * r, in] in the compute dtype.
template <size_t N>
at::Tensor StackedA(const std::array<Projection, N>& ps, const std::vector<size_t>& adapted,
                    const LoraBlock& lora, c10::ScalarType dtype) {
  std::vector<at::Tensor> as;
  for (size_t i : adapted) as.push_back(lora.a[ps[i].target]);
  return (as.size() == 1 ? as[0] : at::cat(as, 0)).to(dtype);
}

// y_i = x W_i^T (+ b_i) + s * (dropout(x) A_i^T) B_i^T for the projections reading x [N, in].
// Without dropout the A's share one GEMM; each low-rank term is added in addmm's epilogue.
template <size_t N>
std::array<at::Tensor, N> ProjectGroup(const at::Tensor& x, const std::array<Projection, N>& ps,
                                       const LoraBlock& lora, const at::Tensor& stacked,
                                       const BlockCompute& c, BlockTape* tape) {
  std::array<at::Tensor, N> ys;
  for (size_t i = 0; i < N; ++i) {
    const Projection& p = ps[i];
    ys[i] = p.bias && p.bias->defined() ? at::addmm(*p.bias, x, p.weight->t())
                                        : at::mm(x, p.weight->t());
  }
  const std::vector<size_t> adapted = Adapted(ps, lora);
  if (adapted.empty()) return ys;
  const auto dtype = x.scalar_type();
  const double s = c.lora_scale;
  if (!DropoutActive(c)) {
    const int64_t r = lora.a[ps[adapted[0]].target].size(0);
    const at::Tensor a = stacked.defined() ? stacked : StackedA(ps, adapted, lora, dtype);
    at::Tensor u = at::mm(x, a.t());  // [N, k * r]
    for (size_t j = 0; j < adapted.size(); ++j) {
      const int t = ps[adapted[j]].target;
      at::Tensor uj = u.narrow(1, static_cast<int64_t>(j) * r, r);
      ys[adapted[j]].addmm_(uj, lora.b[t].to(dtype).t(), 1.0, s);
      if (tape) tape->lora[t].u = uj;
    }
    return ys;
  }
  // peft draws one dropout mask per projection, even where projections share an input.
  for (size_t i : adapted) {
    const int t = ps[i].target;
    auto [xd, mask] = at::native_dropout(x, c.dropout, /*train=*/true);
    at::Tensor u = at::mm(xd, lora.a[t].to(dtype).t());
    ys[i].addmm_(u, lora.b[t].to(dtype).t(), 1.0, s);
    if (tape) tape->lora[t] = BlockTape::Adapter{u, xd, mask};
  }
  return ys;
}

// The backward of ProjectGroup: dL/dx for the outputs' gradients dys, and each adapter's
// A and B gradients (f32) into `grads`. Releases the tape's adapter tensors.
template <size_t N>
at::Tensor BackpropGroup(const at::Tensor& x, const std::array<Projection, N>& ps,
                         const std::array<at::Tensor, N>& dys, const LoraBlock& lora,
                         const at::Tensor& stacked, const BlockCompute& c, BlockTape& tape,
                         LoraBlockGrads& grads, bool need_dx) {
  at::Tensor dx;
  if (need_dx) {
    dx = at::mm(dys[0], *ps[0].weight);
    for (size_t i = 1; i < N; ++i) dx.addmm_(dys[i], *ps[i].weight);
  }
  const std::vector<size_t> adapted = Adapted(ps, lora);
  if (adapted.empty()) return dx;
  const auto dtype = dys[0].scalar_type();
  const double s = c.lora_scale;
  // g_i = s * dy_i B_i [N, r]: dA_i = g_i^T x_i and dx += g_i A_i; dB_i = s * dy_i^T u_i.
  std::vector<at::Tensor> gs;
  for (size_t i : adapted) {
    const int t = ps[i].target;
    BlockTape::Adapter& a = tape.lora[t];
    gs.push_back(at::mm(dys[i], lora.b[t].to(dtype)).mul_(s));
    grads.b[t] = at::mm(dys[i].t(), a.u).mul_(s).to(at::kFloat);
    a.u = at::Tensor();
  }
  if (!DropoutActive(c)) {
    const int64_t r = lora.a[ps[adapted[0]].target].size(0);
    at::Tensor g = gs.size() == 1 ? gs[0] : at::cat(gs, 1);  // [N, k * r]
    if (need_dx) dx.addmm_(g, stacked.defined() ? stacked : StackedA(ps, adapted, lora, dtype));
    at::Tensor da = at::mm(g.t(), x).to(at::kFloat);  // [k * r, in]
    for (size_t j = 0; j < adapted.size(); ++j)
      grads.a[ps[adapted[j]].target] = da.narrow(0, static_cast<int64_t>(j) * r, r);
    return dx;
  }
  const double keep_scale = 1.0 / (1.0 - c.dropout);
  for (size_t j = 0; j < adapted.size(); ++j) {
    const int t = ps[adapted[j]].target;
    BlockTape::Adapter& a = tape.lora[t];
    grads.a[t] = at::mm(gs[j].t(), a.xd).to(at::kFloat);
    if (need_dx)
      dx.add_(at::native_dropout_backward(at::mm(gs[j], lora.a[t].to(dtype)), a.mask, keep_scale));
    a = BlockTape::Adapter{};
  }
  return dx;
}

std::array<Projection, 3> Qkv(const BlockWeights& w) {
  return {{{kQProj, &w.q_proj, &w.q_bias},
           {kKProj, &w.k_proj, &w.k_bias},
           {kVProj, &w.v_proj, &w.v_bias}}};
}
std::array<Projection, 1> OProj(const BlockWeights& w) { return {{{kOProj, &w.o_proj, nullptr}}}; }
std::array<Projection, 2> GateUp(const BlockWeights& w) {
  return {{{kGateProj, &w.gate_proj, nullptr}, {kUpProj, &w.up_proj, nullptr}}};
}
std::array<Projection, 1> Down(const BlockWeights& w) {
  return {{{kDownProj, &w.down_proj, nullptr}}};
}

// The forward of BlockForward and BlockForwardTaped; `tape` null keeps nothing (and under
// grad mode lets autograd differentiate everything: the reference path).
at::Tensor Forward(const at::Tensor& x, const BlockWeights& w, const LoraBlock& lora,
                   const std::array<at::Tensor, kNumGroups>& stacked, const BlockCompute& c,
                   BlockTape* tape) {
  const ModelConfig& cfg = *c.config;
  if (DropoutActive(c)) {
    at::Generator gen = at::globalContext().defaultGenerator(x.device());
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(c.dropout_seed);
  }
  const int64_t batch = x.size(0), seq = x.size(1), hidden = x.size(2);
  const int64_t hd = cfg.head_dim;
  const double eps = cfg.rms_norm_eps;
  at::Tensor rstd;

  at::Tensor x2 = x.reshape({-1, hidden});
  at::Tensor h1 = RmsNormRstd(x2, w.input_norm, eps, &rstd);
  auto [q, k, v] = ProjectGroup(h1, Qkv(w), lora, stacked[kQkvGroup], c, tape);
  if (tape) {
    tape->x = x;
    tape->rstd_in = rstd;
    tape->h1 = h1;
  }
  q = q.view({batch, seq, -1, hd});
  k = k.view({batch, seq, -1, hd});
  v = v.view({batch, seq, -1, hd}).transpose(1, 2);
  if (cfg.qk_norm) {
    at::Tensor rq, rk;
    at::Tensor qn = RmsNormRstd(q, w.q_norm, eps, &rq);
    at::Tensor kn = RmsNormRstd(k, w.k_norm, eps, &rk);
    if (tape) {
      tape->q_pre = q;
      tape->k_pre = k;
      tape->rstd_q = rq;
      tape->rstd_k = rk;
    }
    q = qn;
    k = kn;
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  q = RopeForward(q, c.rope->cos, c.rope->sin);
  k = RopeForward(k, c.rope->cos, c.rope->sin);
  at::Tensor attn;
  if (tape) {
    // The one autograd node of a taped block: attention's own backward (flash on CUDA).
    c10::AutoGradMode grad(true);
    tape->q = q.detach().requires_grad_(true);
    tape->k = k.detach().requires_grad_(true);
    tape->v = v.detach().requires_grad_(true);
    tape->attn = CausalAttention(tape->q, tape->k, tape->v);
    attn = tape->attn.detach();
  } else {
    attn = CausalAttention(q, k, v);  // [B, h, S, D]
  }
  at::Tensor attn_flat = attn.transpose(1, 2).reshape({batch * seq, -1});
  auto [o] = ProjectGroup(attn_flat, OProj(w), lora, stacked[kOGroup], c, tape);
  at::Tensor out = x2 + o;

  at::Tensor h2 = RmsNormRstd(out, w.post_norm, eps, &rstd);
  auto [gate, up] = ProjectGroup(h2, GateUp(w), lora, stacked[kGateUpGroup], c, tape);
  at::Tensor z = SwiGlu(gate, up);
  auto [down] = ProjectGroup(z, Down(w), lora, stacked[kDownGroup], c, tape);
  if (tape) {
    tape->attn_flat = attn_flat;
    tape->out = out;
    tape->rstd_post = rstd;
    tape->h2 = h2;
    tape->gate = gate;
    tape->up = up;
    tape->z = z;
  }
  // Summed as [B, S, H] views so that the result is a tensor of its own, not a view: a
  // custom autograd function may not return a view created without grad.
  return out.view({batch, seq, hidden}) + down.view({batch, seq, hidden});
}

}  // namespace

at::Tensor BlockForward(const at::Tensor& x, const BlockWeights& w, const LoraBlock& lora,
                        const BlockCompute& c) {
  return Forward(x, w, lora, {}, c, nullptr);
}

LoraBlockCast CastLoraBlock(const LoraBlock& lora, c10::ScalarType dtype) {
  c10::NoGradGuard no_grad;
  LoraBlockCast cast;
  for (int t = 0; t < kNumLoraTargets; ++t) {
    if (!lora.a[t].defined()) continue;
    cast.lora.a[t] = lora.a[t].to(dtype);
    cast.lora.b[t] = lora.b[t].to(dtype);
  }
  auto stack = [&](auto ps) {
    const std::vector<size_t> adapted = Adapted(ps, cast.lora);
    return adapted.empty() ? at::Tensor() : StackedA(ps, adapted, cast.lora, dtype);
  };
  const BlockWeights none;
  cast.stacked[kQkvGroup] = stack(Qkv(none));
  cast.stacked[kOGroup] = stack(OProj(none));
  cast.stacked[kGateUpGroup] = stack(GateUp(none));
  cast.stacked[kDownGroup] = stack(Down(none));
  return cast;
}

at::Tensor BlockForwardTaped(const at::Tensor& x, const BlockWeights& w, const LoraBlockCast& cast,
                             const BlockCompute& c, BlockTape* tape) {
  LS_CHECK(!tape || !tape->x.defined(), "BlockForwardTaped needs an empty tape");
  c10::NoGradGuard no_grad;
  return Forward(x, w, cast.lora, cast.stacked, c, tape);
}

at::Tensor BlockBackward(BlockTape& tape, const BlockWeights& w, const LoraBlockCast& cast,
                         const BlockCompute& c, const at::Tensor& dy, bool need_dx,
                         LoraBlockGrads& grads) {
  LS_CHECK(tape.x.defined(), "BlockBackward needs the tape of a BlockForwardTaped");
  c10::NoGradGuard no_grad;
  const ModelConfig& cfg = *c.config;
  const int64_t batch = tape.x.size(0), seq = tape.x.size(1), hidden = tape.x.size(2);
  const int64_t hd = cfg.head_dim;
  at::Tensor dy2 = dy.reshape({-1, hidden});

  // MLP: y = out + down(silu(gate) * up).
  at::Tensor dz = BackpropGroup(tape.z, Down(w), {dy2}, cast.lora, cast.stacked[kDownGroup], c,
                                tape, grads, true);
  tape.z = at::Tensor();
  auto [dgate, dup] = SwiGluBackward(dz, tape.gate, tape.up);
  tape.gate = tape.up = at::Tensor();
  at::Tensor dh2 = BackpropGroup(tape.h2, GateUp(w), {dgate, dup}, cast.lora,
                                 cast.stacked[kGateUpGroup], c, tape, grads, true);
  dgate = dup = dz = tape.h2 = at::Tensor();
  at::Tensor dout = dy2 + RmsNormBackward(dh2, tape.out, tape.rstd_post, w.post_norm);
  dh2 = tape.out = tape.rstd_post = at::Tensor();

  // Attention: out = x + o_proj(attention(rope(norm(q)), rope(norm(k)), v)).
  at::Tensor dattn = BackpropGroup(tape.attn_flat, OProj(w), {dout}, cast.lora,
                                   cast.stacked[kOGroup], c, tape, grads, true);
  tape.attn_flat = at::Tensor();
  dattn = dattn.view({batch, seq, -1, hd}).transpose(1, 2);  // [B, h, S, D]
  torch::autograd::variable_list g =
      torch::autograd::grad({tape.attn}, {tape.q, tape.k, tape.v}, {dattn},
                            /*retain_graph=*/false, /*create_graph=*/false);
  tape.attn = tape.q = tape.k = tape.v = dattn = at::Tensor();
  at::Tensor dq = RopeBackward(g[0], c.rope->cos, c.rope->sin).transpose(1, 2);
  at::Tensor dk = RopeBackward(g[1], c.rope->cos, c.rope->sin).transpose(1, 2);
  at::Tensor dv = g[2].transpose(1, 2);
  g.clear();
  if (cfg.qk_norm) {
    dq = RmsNormBackward(dq, tape.q_pre, tape.rstd_q, w.q_norm);
    dk = RmsNormBackward(dk, tape.k_pre, tape.rstd_k, w.k_norm);
    tape.q_pre = tape.k_pre = tape.rstd_q = tape.rstd_k = at::Tensor();
  }
  const int64_t n = batch * seq;
  at::Tensor dh1 = BackpropGroup(tape.h1, Qkv(w),
                                 {dq.reshape({n, -1}), dk.reshape({n, -1}), dv.reshape({n, -1})},
                                 cast.lora, cast.stacked[kQkvGroup], c, tape, grads, need_dx);
  dq = dk = dv = tape.h1 = at::Tensor();
  at::Tensor dx;
  if (need_dx) {
    at::Tensor x2 = tape.x.reshape({-1, hidden});
    dx = dout.view({batch, seq, hidden}) +
         RmsNormBackward(dh1, x2, tape.rstd_in, w.input_norm).view({batch, seq, hidden});
  }
  tape = BlockTape{};
  return dx;
}

}  // namespace lorastream::worker
