#include "worker/model/block.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <vector>

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"
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

// Where each job's rows lie in the group's concatenation [N, ...]. A group of one is the job
// alone: its tensors are used as they are, never copied.
class GroupRows {
 public:
  explicit GroupRows(const std::vector<at::Tensor>& xs) {
    int64_t offset = 0;
    for (const at::Tensor& x : xs) {
      offset_.push_back(offset);
      count_.push_back(x.size(0) * x.size(1));
      offset += count_.back();
    }
  }
  size_t size() const { return count_.size(); }
  // Every job has the same number of rows: the concatenation is [size(), rows, ...].
  bool uniform() const {
    return std::all_of(count_.begin(), count_.end(), [&](int64_t c) { return c == count_[0]; });
  }
  int64_t rows(size_t j) const { return count_[j]; }
  int64_t offset(size_t j) const { return offset_[j]; }
  // parts[j] [n_j, ...] as one [N, ...].
  at::Tensor Cat(const std::vector<at::Tensor>& parts) const {
    return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
  }
  // Job j's rows of t [N, ...] (a view).
  at::Tensor Of(const at::Tensor& t, size_t j) const {
    return size() == 1 ? t : t.narrow(0, offset_[j], count_[j]);
  }

 private:
  std::vector<int64_t> offset_, count_;
};

// Whether the base GEMMs over a group's rows run per job: on the CPU, where a GEMM's row sums
// may depend on its row count (OpenBLAS's kernels for some CPUs, Zen and Haswell among them,
// sum an input gradient's rows otherwise than a GEMM of fewer rows would), so that each job
// computes bit for bit what it computes alone. On CUDA one GEMM covers every job's rows.
bool PerJobBaseGemms(const at::Tensor& t, const GroupRows& rows) {
  return rows.size() > 1 && t.device().is_cpu();
}

// Each job's dropout masks from its own seed, drawn from the device's default generator (as
// native_dropout draws them): alone, the generator is seeded once, as a job's pass always
// did; in a group, each job's generator state is kept here and restored around its draws, so
// that its masks are those of the job alone.
class DropoutStreams {
 public:
  DropoutStreams(c10::Device device, const std::vector<BlockJob>& jobs)
      : gen_(at::globalContext().defaultGenerator(device)) {
    states_.resize(jobs.size());
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (!DropoutActive(*jobs[j].compute)) continue;
      std::lock_guard<std::mutex> lock(gen_.mutex());
      gen_.set_current_seed(jobs[j].compute->dropout_seed);
      if (jobs.size() > 1) states_[j] = gen_.get_state();
    }
  }
  // Job j draws next (a group restores its state).
  void Enter(size_t j) {
    if (states_.size() == 1) return;
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(states_[j]);
  }
  // Job j's draws are done (a group keeps its state).
  void Leave(size_t j) {
    if (states_.size() == 1) return;
    std::lock_guard<std::mutex> lock(gen_.mutex());
    states_[j] = gen_.get_state();
  }

 private:
  at::Generator gen_;
  std::vector<at::Tensor> states_;
};

// What every job of a batched projection group shares: K jobs of n rows each, the adapted
// projections (indices into the group), the rank and the LoRA scale.
struct LoraBatch {
  int64_t K = 0, n = 0;
  std::vector<size_t> adapted;
  int64_t r = 0;
  double s = 0;
};

// Whether a projection group's low-rank terms run batched over the jobs (one bmm for all of
// them instead of a GEMM per job), and what they share: on CUDA, for two or more jobs with the
// same number of rows, adapted projections, rank and scale, and no dropout. (On the CPU every
// job keeps its own GEMMs: its results stay bit for bit those of the job alone.)
template <size_t N>
std::optional<LoraBatch> BatchedLora(const at::Tensor& x, const GroupRows& rows,
                                     const std::array<Projection, N>& ps, Group group,
                                     const std::vector<BlockJob>& jobs) {
  if (jobs.size() < 2 || !x.is_cuda() || !rows.uniform()) return std::nullopt;
  LoraBatch b;
  b.K = static_cast<int64_t>(jobs.size());
  b.n = rows.rows(0);
  b.adapted = Adapted(ps, jobs[0].lora->lora);
  if (b.adapted.empty()) return std::nullopt;
  const int first = ps[b.adapted[0]].target;
  b.r = jobs[0].lora->lora.a[first].size(0);
  b.s = jobs[0].compute->lora_scale;
  for (const BlockJob& job : jobs) {
    const LoraBlock& lora = job.lora->lora;
    if (DropoutActive(*job.compute) || job.compute->lora_scale != b.s ||
        !job.lora->stacked[group].defined() || Adapted(ps, lora) != b.adapted ||
        lora.a[first].size(0) != b.r)
      return std::nullopt;
  }
  return b;
}

// Each job's stacked A's of `group` [k * r, in] as one [K, k * r, in].
at::Tensor JobsStackedA(const std::vector<BlockJob>& jobs, Group group) {
  std::vector<at::Tensor> as;
  for (const BlockJob& job : jobs) as.push_back(job.lora->stacked[group]);
  return at::stack(as);
}

// Each job's B of target t [out, r] as one [K, out, r].
at::Tensor JobsB(const std::vector<BlockJob>& jobs, int t) {
  std::vector<at::Tensor> bs;
  for (const BlockJob& job : jobs) bs.push_back(job.lora->lora.b[t]);
  return at::stack(bs);
}

// y_i = x W_i^T (+ b_i) + s * (dropout(x) A_i^T) B_i^T for the projections reading x [N, in],
// the rows of every job of the group: the base GEMM once over all rows, each job's low-rank
// term on its own rows. Without dropout a job's A's share one GEMM; each low-rank term is
// added in addmm's epilogue.
template <size_t N>
std::array<at::Tensor, N> ProjectGroup(const at::Tensor& x, const GroupRows& rows,
                                       const std::array<Projection, N>& ps, Group group,
                                       const std::vector<BlockJob>& jobs, DropoutStreams& rng,
                                       BlockTape* tape) {
  std::array<at::Tensor, N> ys;
  for (size_t i = 0; i < N; ++i) {
    const Projection& p = ps[i];
    const auto base = [&](const at::Tensor& xj) {
      return p.bias && p.bias->defined() ? at::addmm(*p.bias, xj, p.weight->t())
                                         : at::mm(xj, p.weight->t());
    };
    if (PerJobBaseGemms(x, rows)) {
      std::vector<at::Tensor> parts;
      for (size_t j = 0; j < rows.size(); ++j) parts.push_back(base(rows.Of(x, j)));
      ys[i] = rows.Cat(parts);
    } else {
      ys[i] = base(x);
    }
  }
  const auto dtype = x.scalar_type();
  if (const std::optional<LoraBatch> batch = BatchedLora(x, rows, ps, group, jobs)) {
    const auto& [K, n, adapted, r, s] = *batch;
    const at::Tensor u = at::bmm(x.reshape({K, n, -1}), JobsStackedA(jobs, group).transpose(1, 2));
    for (size_t k = 0; k < adapted.size(); ++k) {
      const int t = ps[adapted[k]].target;
      const at::Tensor uk = u.narrow(2, static_cast<int64_t>(k) * r, r);  // [K, n, r]
      ys[adapted[k]].view({K, n, -1}).baddbmm_(uk, JobsB(jobs, t).transpose(1, 2), 1.0, s);
      if (tape)
        for (int64_t j = 0; j < K; ++j) tape->jobs[j].lora[t].u = uk[j];
    }
    return ys;
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    const LoraBlock& lora = jobs[j].lora->lora;
    const BlockCompute& c = *jobs[j].compute;
    const std::vector<size_t> adapted = Adapted(ps, lora);
    if (adapted.empty()) continue;
    const double s = c.lora_scale;
    const at::Tensor xj = rows.Of(x, j);
    BlockTape::Job* kept = tape ? &tape->jobs[j] : nullptr;
    if (!DropoutActive(c)) {
      const int64_t r = lora.a[ps[adapted[0]].target].size(0);
      const at::Tensor& stacked = jobs[j].lora->stacked[group];
      const at::Tensor a = stacked.defined() ? stacked : StackedA(ps, adapted, lora, dtype);
      at::Tensor u = at::mm(xj, a.t());  // [n, k * r]
      for (size_t k = 0; k < adapted.size(); ++k) {
        const int t = ps[adapted[k]].target;
        at::Tensor uk = u.narrow(1, static_cast<int64_t>(k) * r, r);
        rows.Of(ys[adapted[k]], j).addmm_(uk, lora.b[t].to(dtype).t(), 1.0, s);
        if (kept) kept->lora[t].u = uk;
      }
      continue;
    }
    // peft draws one dropout mask per projection, even where projections share an input.
    rng.Enter(j);
    for (size_t i : adapted) {
      const int t = ps[i].target;
      auto [xd, mask] = at::native_dropout(xj, c.dropout, /*train=*/true);
      at::Tensor u = at::mm(xd, lora.a[t].to(dtype).t());
      rows.Of(ys[i], j).addmm_(u, lora.b[t].to(dtype).t(), 1.0, s);
      if (kept) kept->lora[t] = BlockTape::Adapter{u, xd, mask};
    }
    rng.Leave(j);
  }
  return ys;
}

// The backward of ProjectGroup: dL/dx for the outputs' gradients dys (every job's rows; dY W
// once over all of them), and each job's adapter A and B gradients (f32) into grads[j].
// Releases the tape's adapter tensors.
template <size_t N>
at::Tensor BackpropGroup(const at::Tensor& x, const GroupRows& rows,
                         const std::array<Projection, N>& ps, const std::array<at::Tensor, N>& dys,
                         Group group, const std::vector<BlockJob>& jobs, BlockTape& tape,
                         std::vector<LoraBlockGrads>& grads, bool need_dx) {
  at::Tensor dx;
  if (need_dx) {
    const auto base = [&](const auto& dy_of) {
      at::Tensor d = at::mm(dy_of(0), *ps[0].weight);
      for (size_t i = 1; i < N; ++i) d.addmm_(dy_of(i), *ps[i].weight);
      return d;
    };
    if (PerJobBaseGemms(dys[0], rows)) {
      std::vector<at::Tensor> parts;
      for (size_t j = 0; j < rows.size(); ++j)
        parts.push_back(base([&](size_t i) { return rows.Of(dys[i], j); }));
      dx = rows.Cat(parts);
    } else {
      dx = base([&](size_t i) { return dys[i]; });
    }
  }
  const auto dtype = dys[0].scalar_type();
  if (const std::optional<LoraBatch> batch = BatchedLora(x, rows, ps, group, jobs)) {
    const auto& [K, n, adapted, r, s] = *batch;
    // Per job as below, each GEMM once for all jobs: g_i = s * dy_i B_i [K, n, r],
    // dB_i = s * dy_i^T u_i, dA = g^T x, dx += g A.
    std::vector<at::Tensor> gs;
    for (size_t i : adapted) {
      const int t = ps[i].target;
      const at::Tensor dy = dys[i].reshape({K, n, -1});
      std::vector<at::Tensor> us;
      for (int64_t j = 0; j < K; ++j) {
        us.push_back(tape.jobs[j].lora[t].u);
        tape.jobs[j].lora[t].u = at::Tensor();
      }
      gs.push_back(at::bmm(dy, JobsB(jobs, t)).mul_(s));
      const at::Tensor db = at::bmm(dy.transpose(1, 2), at::stack(us)).mul_(s).to(at::kFloat);
      for (int64_t j = 0; j < K; ++j) grads[j].b[t] = db[j];
    }
    const at::Tensor g = gs.size() == 1 ? gs[0] : at::cat(gs, 2);  // [K, n, k * r]
    if (need_dx) dx.view({K, n, -1}).baddbmm_(g, JobsStackedA(jobs, group));
    const at::Tensor da = at::bmm(g.transpose(1, 2), x.reshape({K, n, -1})).to(at::kFloat);
    for (int64_t j = 0; j < K; ++j)
      for (size_t k = 0; k < adapted.size(); ++k)
        grads[j].a[ps[adapted[k]].target] = da[j].narrow(0, static_cast<int64_t>(k) * r, r);
    return dx;
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    const LoraBlock& lora = jobs[j].lora->lora;
    const BlockCompute& c = *jobs[j].compute;
    const std::vector<size_t> adapted = Adapted(ps, lora);
    if (adapted.empty()) continue;
    const double s = c.lora_scale;
    BlockTape::Job& kept = tape.jobs[j];
    // g_i = s * dy_i B_i [n, r]: dA_i = g_i^T x_i and dx += g_i A_i; dB_i = s * dy_i^T u_i.
    std::vector<at::Tensor> gs;
    for (size_t i : adapted) {
      const int t = ps[i].target;
      BlockTape::Adapter& a = kept.lora[t];
      const at::Tensor dy = rows.Of(dys[i], j);
      gs.push_back(at::mm(dy, lora.b[t].to(dtype)).mul_(s));
      grads[j].b[t] = at::mm(dy.t(), a.u).mul_(s).to(at::kFloat);
      a.u = at::Tensor();
    }
    if (!DropoutActive(c)) {
      const int64_t r = lora.a[ps[adapted[0]].target].size(0);
      const at::Tensor& stacked = jobs[j].lora->stacked[group];
      at::Tensor g = gs.size() == 1 ? gs[0] : at::cat(gs, 1);  // [n, k * r]
      if (need_dx)
        rows.Of(dx, j).addmm_(g, stacked.defined() ? stacked : StackedA(ps, adapted, lora, dtype));
      at::Tensor da = at::mm(g.t(), rows.Of(x, j)).to(at::kFloat);  // [k * r, in]
      for (size_t k = 0; k < adapted.size(); ++k)
        grads[j].a[ps[adapted[k]].target] = da.narrow(0, static_cast<int64_t>(k) * r, r);
      continue;
    }
    const double keep_scale = 1.0 / (1.0 - c.dropout);
    for (size_t k = 0; k < adapted.size(); ++k) {
      const int t = ps[adapted[k]].target;
      BlockTape::Adapter& a = kept.lora[t];
      grads[j].a[t] = at::mm(gs[k].t(), a.xd).to(at::kFloat);
      if (need_dx)
        rows.Of(dx, j).add_(
            at::native_dropout_backward(at::mm(gs[k], lora.a[t].to(dtype)), a.mask, keep_scale));
      a = BlockTape::Adapter{};
    }
  }
  return dx;
}

// Each job's rows and expert adapters for the mixture-of-experts MLP.
std::vector<MoeJob> MoeJobs(const GroupRows& rows, const std::vector<BlockJob>& jobs) {
  std::vector<MoeJob> out;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const BlockCompute& c = *jobs[j].compute;
    if (DropoutActive(c))
      throw Error(ErrorCode::kRefused,
                  "lora.dropout must be 0 for a mixture of experts (" + c.config->model_type +
                      "): peft applies no dropout to transformers 5's fused experts");
    out.push_back({rows.offset(j), rows.rows(j), &jobs[j].lora->lora, c.lora_scale,
                   jobs[j].lora->experts_a, jobs[j].lora->experts_b});
  }
  return out;
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

// The forward of a group (BlockForward and BlockForwardTaped: a group of one); `tape` null
// keeps nothing (and under grad mode lets autograd differentiate everything: the reference
// path).
std::vector<at::Tensor> Forward(const std::vector<at::Tensor>& xs, const BlockWeights& w,
                                const std::vector<BlockJob>& jobs, BlockTape* tape) {
  LS_CHECK(!xs.empty() && xs.size() == jobs.size(), "a block's group needs one input per job");
  const ModelConfig& cfg = *jobs[0].compute->config;
  DropoutStreams rng(xs[0].device(), jobs);
  const int64_t hidden = xs[0].size(2);
  const int64_t hd = cfg.head_dim;
  const double eps = cfg.rms_norm_eps;
  const GroupRows rows(xs);
  if (tape) tape->jobs.resize(jobs.size());
  at::Tensor rstd;

  std::vector<at::Tensor> x2s;
  for (const at::Tensor& x : xs) x2s.push_back(x.reshape({-1, hidden}));
  const at::Tensor x2 = rows.Cat(x2s);
  at::Tensor h1 = RmsNormRstd(x2, w.input_norm, eps, &rstd);
  auto [q, k, v] = ProjectGroup(h1, rows, Qkv(w), kQkvGroup, jobs, rng, tape);
  if (tape) {
    tape->x = x2;
    tape->rstd_in = rstd;
    tape->h1 = h1;
  }
  const int64_t n = x2.size(0);
  q = q.view({n, -1, hd});
  k = k.view({n, -1, hd});
  v = v.view({n, -1, hd});
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
  // Attention per job: its own length, rotary tables and causal mask.
  std::vector<at::Tensor> attns;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const BlockCompute& c = *jobs[j].compute;
    const int64_t batch = xs[j].size(0), seq = xs[j].size(1);
    auto heads = [&](const at::Tensor& t) {  // [B, h, S, D]
      return rows.Of(t, j).view({batch, seq, -1, hd}).transpose(1, 2);
    };
    const at::Tensor qj = RopeForward(heads(q), c.rope->cos, c.rope->sin);
    const at::Tensor kj = RopeForward(heads(k), c.rope->cos, c.rope->sin);
    const at::Tensor vj = heads(v);
    at::Tensor attn;
    if (tape) {
      // The one autograd node of a taped block: attention's own backward (flash on CUDA).
      c10::AutoGradMode grad(true);
      BlockTape::Job& kept = tape->jobs[j];
      kept.batch = batch;
      kept.seq = seq;
      kept.q = qj.detach().requires_grad_(true);
      kept.k = kj.detach().requires_grad_(true);
      kept.v = vj.detach().requires_grad_(true);
      kept.attn = CausalAttention(kept.q, kept.k, kept.v);
      attn = kept.attn.detach();
    } else {
      attn = CausalAttention(qj, kj, vj);  // [B, h, S, D]
    }
    attns.push_back(attn.transpose(1, 2).reshape({batch * seq, -1}));
  }
  at::Tensor attn_flat = rows.Cat(attns);
  auto [o] = ProjectGroup(attn_flat, rows, OProj(w), kOGroup, jobs, rng, tape);
  at::Tensor out = x2 + o;

  at::Tensor h2 = RmsNormRstd(out, w.post_norm, eps, &rstd);
  at::Tensor down;
  if (cfg.is_moe()) {
    down = MoeForward(h2, w, cfg, MoeJobs(rows, jobs), PerJobBaseGemms(h2, rows),
                      tape ? &tape->moe : nullptr);
  } else {
    auto [gate, up] = ProjectGroup(h2, rows, GateUp(w), kGateUpGroup, jobs, rng, tape);
    at::Tensor z = SwiGlu(gate, up);
    down = std::get<0>(ProjectGroup(z, rows, Down(w), kDownGroup, jobs, rng, tape));
    if (tape) {
      tape->gate = gate;
      tape->up = up;
      tape->z = z;
    }
  }
  if (tape) {
    tape->attn_flat = attn_flat;
    tape->out = out;
    tape->rstd_post = rstd;
    tape->h2 = h2;
  }
  // Summed as [B, S, H] views so that each result is a tensor of its own, not a view: a
  // custom autograd function may not return a view created without grad.
  std::vector<at::Tensor> ys;
  for (size_t j = 0; j < jobs.size(); ++j)
    ys.push_back(rows.Of(out, j).view(xs[j].sizes()) + rows.Of(down, j).view(xs[j].sizes()));
  return ys;
}

}  // namespace

at::Tensor BlockForward(const at::Tensor& x, const BlockWeights& w, const LoraBlock& lora,
                        const BlockCompute& c) {
  const LoraBlockCast uncast{lora, {}};  // the f32 parameters: autograd reaches them
  return Forward({x}, w, {BlockJob{&uncast, &c}}, nullptr)[0];
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
  cast.lora.experts.resize(lora.experts.size());
  for (int p = 0; p < 3; ++p) {
    // Stacked when every expert adapts the projection at one shape (as every adapter we make
    // does): two kernels for the experts instead of two per expert.
    std::vector<at::Tensor> as, bs;
    for (const ExpertLora& e : lora.experts) {
      if (!e.a[p].defined() || !e.a[p].sizes().equals(lora.experts.front().a[p].sizes()) ||
          !e.b[p].sizes().equals(lora.experts.front().b[p].sizes()))
        break;
      as.push_back(e.a[p]);
      bs.push_back(e.b[p]);
    }
    if (!as.empty() && as.size() == lora.experts.size()) {
      cast.experts_a[p] = at::stack(as).to(dtype);
      cast.experts_b[p] = at::stack(bs).to(dtype);
      for (size_t e = 0; e < lora.experts.size(); ++e) {
        cast.lora.experts[e].a[p] = cast.experts_a[p][static_cast<int64_t>(e)];
        cast.lora.experts[e].b[p] = cast.experts_b[p][static_cast<int64_t>(e)];
      }
      continue;
    }
    for (size_t e = 0; e < lora.experts.size(); ++e) {
      if (!lora.experts[e].a[p].defined()) continue;
      cast.lora.experts[e].a[p] = lora.experts[e].a[p].to(dtype);
      cast.lora.experts[e].b[p] = lora.experts[e].b[p].to(dtype);
    }
  }
  return cast;
}

std::vector<at::Tensor> GroupBlockForwardTaped(const std::vector<at::Tensor>& xs,
                                               const BlockWeights& w,
                                               const std::vector<BlockJob>& jobs, BlockTape* tape) {
  LS_CHECK(!tape || !tape->x.defined(), "BlockForwardTaped needs an empty tape");
  c10::NoGradGuard no_grad;
  return Forward(xs, w, jobs, tape);
}

at::Tensor BlockForwardTaped(const at::Tensor& x, const BlockWeights& w, const LoraBlockCast& cast,
                             const BlockCompute& c, BlockTape* tape) {
  return GroupBlockForwardTaped({x}, w, {BlockJob{&cast, &c}}, tape)[0];
}

std::vector<at::Tensor> GroupBlockBackward(BlockTape& tape, const BlockWeights& w,
                                           const std::vector<BlockJob>& jobs,
                                           const std::vector<at::Tensor>& dys, bool need_dx,
                                           std::vector<LoraBlockGrads>& grads) {
  LS_CHECK(tape.x.defined(), "BlockBackward needs the tape of a BlockForwardTaped");
  LS_CHECK(tape.jobs.size() == jobs.size() && dys.size() == jobs.size(),
           "BlockBackward needs the jobs and one output gradient per job of its forward");
  c10::NoGradGuard no_grad;
  const ModelConfig& cfg = *jobs[0].compute->config;
  const int64_t hidden = tape.x.size(1);
  const int64_t hd = cfg.head_dim;
  std::vector<at::Tensor> shapes;  // each job's output [B, S, H] (for its rows)
  for (const at::Tensor& dy : dys) shapes.push_back(dy);
  const GroupRows rows(shapes);
  grads.assign(jobs.size(), LoraBlockGrads{});
  std::vector<at::Tensor> dy2s;
  for (const at::Tensor& dy : dys) dy2s.push_back(dy.reshape({-1, hidden}));
  at::Tensor dy2 = rows.Cat(dy2s);
  dy2s.clear();

  // MLP: y = out + down(silu(gate) * up), or the experts' weighted sum.
  at::Tensor dh2;
  if (cfg.is_moe()) {
    dh2 = MoeBackward(tape.moe, tape.h2, w, MoeJobs(rows, jobs), PerJobBaseGemms(dy2, rows), dy2,
                      grads);
  } else {
    at::Tensor dz =
        BackpropGroup(tape.z, rows, Down(w), {dy2}, kDownGroup, jobs, tape, grads, true);
    tape.z = at::Tensor();
    auto [dgate, dup] = SwiGluBackward(dz, tape.gate, tape.up);
    tape.gate = tape.up = at::Tensor();
    dh2 = BackpropGroup(tape.h2, rows, GateUp(w), {dgate, dup}, kGateUpGroup, jobs, tape, grads,
                        true);
  }
  tape.h2 = at::Tensor();
  at::Tensor dout = dy2 + RmsNormBackward(dh2, tape.out, tape.rstd_post, w.post_norm);
  dh2 = tape.out = tape.rstd_post = dy2 = at::Tensor();

  // Attention: out = x + o_proj(attention(rope(norm(q)), rope(norm(k)), v)), per job.
  at::Tensor dattn =
      BackpropGroup(tape.attn_flat, rows, OProj(w), {dout}, kOGroup, jobs, tape, grads, true);
  tape.attn_flat = at::Tensor();
  std::vector<at::Tensor> dqs, dks, dvs;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const BlockCompute& c = *jobs[j].compute;
    BlockTape::Job& kept = tape.jobs[j];
    const int64_t n = kept.batch * kept.seq;
    at::Tensor dattn_j =
        rows.Of(dattn, j).view({kept.batch, kept.seq, -1, hd}).transpose(1, 2);  // [B, h, S, D]
    torch::autograd::variable_list g =
        torch::autograd::grad({kept.attn}, {kept.q, kept.k, kept.v}, {dattn_j},
                              /*retain_graph=*/false, /*create_graph=*/false);
    kept.attn = kept.q = kept.k = kept.v = at::Tensor();
    // [B, S, h, D] -> [n, h, D]
    dqs.push_back(
        RopeBackward(g[0], c.rope->cos, c.rope->sin).transpose(1, 2).reshape({n, -1, hd}));
    dks.push_back(
        RopeBackward(g[1], c.rope->cos, c.rope->sin).transpose(1, 2).reshape({n, -1, hd}));
    dvs.push_back(g[2].transpose(1, 2).reshape({n, -1, hd}));
  }
  dattn = at::Tensor();
  at::Tensor dq = rows.Cat(dqs), dk = rows.Cat(dks), dv = rows.Cat(dvs);
  dqs.clear();
  dks.clear();
  dvs.clear();
  if (cfg.qk_norm) {
    dq = RmsNormBackward(dq, tape.q_pre, tape.rstd_q, w.q_norm);
    dk = RmsNormBackward(dk, tape.k_pre, tape.rstd_k, w.k_norm);
    tape.q_pre = tape.k_pre = tape.rstd_q = tape.rstd_k = at::Tensor();
  }
  const int64_t n = tape.x.size(0);
  at::Tensor dh1 = BackpropGroup(tape.h1, rows, Qkv(w),
                                 {dq.reshape({n, -1}), dk.reshape({n, -1}), dv.reshape({n, -1})},
                                 kQkvGroup, jobs, tape, grads, need_dx);
  dq = dk = dv = tape.h1 = at::Tensor();
  std::vector<at::Tensor> dxs(jobs.size());
  if (need_dx) {
    at::Tensor dx = dout + RmsNormBackward(dh1, tape.x, tape.rstd_in, w.input_norm);
    for (size_t j = 0; j < jobs.size(); ++j) dxs[j] = rows.Of(dx, j).view(dys[j].sizes());
  }
  tape = BlockTape{};
  return dxs;
}

at::Tensor BlockBackward(BlockTape& tape, const BlockWeights& w, const LoraBlockCast& cast,
                         const BlockCompute& c, const at::Tensor& dy, bool need_dx,
                         LoraBlockGrads& grads) {
  std::vector<LoraBlockGrads> group_grads;
  at::Tensor dx = GroupBlockBackward(tape, w, {BlockJob{&cast, &c}}, {dy}, need_dx, group_grads)[0];
  grads = std::move(group_grads[0]);
  return dx;
}

}  // namespace lorastream::worker
