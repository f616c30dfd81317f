#include "worker/model/moe_mlp.h"

#include <algorithm>
#include <string>

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include "common/base/error.h"
#include "worker/model/fused_ops.h"

// at::_grouped_mm: LibTorch 2.9 and later.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define LORASTREAM_GROUPED_MM 1
#else
#define LORASTREAM_GROUPED_MM 0
#endif

namespace lorastream::worker {

namespace {

// Rows [begin, end) that share their GEMMs: every job's on CUDA, each job's on the CPU.
struct Segment {
  int64_t begin = 0, end = 0;
};

std::vector<Segment> Segments(const std::vector<MoeJob>& jobs, bool per_job_gemms, int64_t rows) {
  if (!per_job_gemms) return {{0, rows}};
  std::vector<Segment> out;
  for (const MoeJob& j : jobs) out.push_back({j.offset, j.offset + j.rows});
  return out;
}

// x W^T over each segment's rows.
at::Tensor SegmentedMm(const at::Tensor& x, const at::Tensor& weight,
                       const std::vector<Segment>& segments) {
  if (segments.size() == 1) return at::mm(x, weight.t());
  std::vector<at::Tensor> parts;
  for (const Segment& s : segments)
    parts.push_back(at::mm(x.narrow(0, s.begin, s.end - s.begin), weight.t()));
  return at::cat(parts, 0);
}

void CheckWeights(const BlockWeights& w, const ModelConfig& config) {
  if (!w.router.defined() || static_cast<int64_t>(w.experts.size()) != config.num_experts)
    throw Error(ErrorCode::kCorrupt, "a mixture-of-experts block needs its router and " +
                                         std::to_string(config.num_experts) + " experts (found " +
                                         std::to_string(w.experts.size()) + ")");
  for (const auto& e : w.experts)
    for (const at::Tensor& t : e)
      if (!t.defined())
        throw Error(ErrorCode::kCorrupt, "a mixture-of-experts block lacks an expert's weight");
}

const at::Tensor* ExpertA(const MoeJob& job, int64_t expert, int proj) {
  if (!job.lora || static_cast<int64_t>(job.lora->experts.size()) <= expert) return nullptr;
  const at::Tensor& a = job.lora->experts[static_cast<size_t>(expert)].a[proj];
  return a.defined() ? &a : nullptr;
}

// y[rows] += s * (x[rows] A^T) B^T for each job's tokens of the run that adapts `proj`,
// keeping x A^T on the tape.
void AddLowRank(const at::Tensor& x, const at::Tensor& y, int proj, int64_t expert,
                const std::vector<MoeJob>& jobs, std::vector<MoeTape::Run::Part>& parts) {
  for (MoeTape::Run::Part& part : parts) {
    const MoeJob& job = jobs[part.job];
    const at::Tensor* a = ExpertA(job, expert, proj);
    if (!a) continue;
    const at::Tensor& b = job.lora->experts[static_cast<size_t>(expert)].b[proj];
    const at::Tensor u = at::mm(x.narrow(0, part.begin, part.count), a->t());
    y.narrow(0, part.begin, part.count).addmm_(u, b.t(), 1.0, job.scale);
    part.u[proj] = u;
  }
}

// The backward of AddLowRank for one projection: each job's A and B gradients (f32) and its
// term of dx.
void BackLowRank(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dx, int proj,
                 int64_t expert, const std::vector<MoeJob>& jobs,
                 const std::vector<MoeTape::Run::Part>& parts, std::vector<LoraBlock>& grads) {
  for (const MoeTape::Run::Part& part : parts) {
    const MoeJob& job = jobs[part.job];
    const at::Tensor* a = ExpertA(job, expert, proj);
    if (!a) continue;
    const at::Tensor& b = job.lora->experts[static_cast<size_t>(expert)].b[proj];
    const at::Tensor dyj = dy.narrow(0, part.begin, part.count);
    const at::Tensor g = at::mm(dyj, b).mul_(job.scale);  // [n, r]
    ExpertLora& out = grads[part.job].experts[static_cast<size_t>(expert)];
    out.b[proj] = at::mm(dyj.t(), part.u[proj]).mul_(job.scale).to(at::kFloat);
    out.a[proj] = at::mm(g.t(), x.narrow(0, part.begin, part.count)).to(at::kFloat);
    dx.narrow(0, part.begin, part.count).addmm_(g, *a);
  }
}

#if LORASTREAM_GROUPED_MM
// a [M, K] times each group's b [K, N] over its run of rows (ends: int32, cumulative), or, with
// a 2-D b [M, N], each group's a^T-run times b-run: [G, K, N] (a given as [K, M]).
at::Tensor GroupedMm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends) {
  return at::_grouped_mm(a, b, ends);
}

// Every expert's projection `proj` as one [E, out, in] tensor: a view where the block's bytes
// hold the experts at one stride (the store's layout: expert by expert, gate, up, down),
// else a copy.
at::Tensor StackedExperts(const BlockWeights& w, int proj) {
  const at::Tensor& first = w.experts.front()[static_cast<size_t>(proj)];
  const int64_t experts = static_cast<int64_t>(w.experts.size());
  bool strided = first.is_contiguous();
  int64_t step = 0;
  if (experts > 1) {
    const at::Tensor& second = w.experts[1][static_cast<size_t>(proj)];
    step = second.storage_offset() - first.storage_offset();
    strided = strided && step >= first.numel();
  }
  for (int64_t e = 0; strided && e < experts; ++e) {
    const at::Tensor& t = w.experts[static_cast<size_t>(e)][static_cast<size_t>(proj)];
    strided = t.is_contiguous() && t.sizes() == first.sizes() &&
              t.storage().is_alias_of(first.storage()) &&
              t.storage_offset() == first.storage_offset() + e * step;
  }
  if (strided)
    return first.as_strided({experts, first.size(0), first.size(1)}, {step, first.size(1), 1},
                            first.storage_offset());
  std::vector<at::Tensor> all;
  for (const auto& e : w.experts) all.push_back(e[static_cast<size_t>(proj)]);
  return at::stack(all);
}

// t [E J, ...] (groups expert-major) times each group's job's LoRA scale: one kernel a job.
void ScaleByJob(const at::Tensor& t, const std::vector<MoeJob>& jobs, int64_t experts) {
  const int64_t per_expert = static_cast<int64_t>(jobs.size());
  const at::Tensor by_job = t.view({experts, per_expert, -1});
  for (int64_t j = 0; j < per_expert; ++j)
    if (jobs[static_cast<size_t>(j)].scale != 1.0)
      by_job.select(1, j).mul_(jobs[static_cast<size_t>(j)].scale);
}

// The (expert, job) groups' low-rank factors of `proj` as [E J, r, in] and [E J, out, r] (B
// times its job's scale), r the largest rank of the jobs adapting it rounded up to a multiple
// of 8, a smaller rank's padded
// with zeros (they add nothing), a job not adapting it all zeros; undefined where no job
// adapts it.
struct StackedLowRank {
  at::Tensor a, b;
  int64_t rank = 0;
};
StackedLowRank StackLowRank(const std::vector<MoeJob>& jobs, int64_t experts, int proj, int64_t in,
                            int64_t out, const at::TensorOptions& options) {
  StackedLowRank s;
  for (const MoeJob& job : jobs)
    for (int64_t e = 0; e < experts; ++e)
      if (const at::Tensor* a = ExpertA(job, e, proj)) s.rank = std::max(s.rank, a->size(0));
  if (s.rank == 0) return s;
  // A multiple of 8: at::_grouped_mm takes rows of 16-byte multiples ([M, r] in bf16).
  s.rank = (s.rank + 7) / 8 * 8;
  // Every job's experts stacked at the full rank (the adapters we make): their stacks
  // interleaved by expert, one kernel for A and one for B, a job's scale folded into a copy.
  bool whole = true;
  for (const MoeJob& job : jobs)
    whole = whole && job.stacked_a[proj].defined() && job.stacked_a[proj].size(1) == s.rank;
  if (whole) {
    if (jobs.size() == 1) {
      s.a = jobs[0].stacked_a[proj];
      s.b =
          jobs[0].scale == 1.0 ? jobs[0].stacked_b[proj] : jobs[0].stacked_b[proj] * jobs[0].scale;
      return s;
    }
    std::vector<at::Tensor> as, bs;
    for (const MoeJob& job : jobs) {
      as.push_back(job.stacked_a[proj]);
      bs.push_back(job.stacked_b[proj]);
    }
    s.a = at::stack(as, 1).view({experts * static_cast<int64_t>(jobs.size()), s.rank, in});
    s.b = at::stack(bs, 1).view({experts * static_cast<int64_t>(jobs.size()), out, s.rank});
    ScaleByJob(s.b, jobs, experts);
    return s;
  }
  std::vector<at::Tensor> as, bs;
  for (int64_t e = 0; e < experts; ++e)
    for (const MoeJob& job : jobs) {
      const at::Tensor* a = ExpertA(job, e, proj);
      if (!a) {
        as.push_back(at::zeros({s.rank, in}, options));
        bs.push_back(at::zeros({out, s.rank}, options));
        continue;
      }
      const at::Tensor& b = job.lora->experts[static_cast<size_t>(e)].b[proj];
      const int64_t pad = s.rank - a->size(0);
      as.push_back(pad ? at::constant_pad_nd(*a, {0, 0, 0, pad}) : *a);
      bs.push_back(pad ? at::constant_pad_nd(b, {0, pad}) : b);
    }
  s.a = at::stack(as);
  s.b = at::stack(bs);
  ScaleByJob(s.b, jobs, experts);
  return s;
}

// Per slot of the sorted order, the rows summed back per token in slot order: [N, H].
at::Tensor SumPerToken(const at::Tensor& sorted, const at::Tensor& order, int64_t tokens,
                       int64_t k) {
  at::Tensor unsorted = at::empty_like(sorted).index_copy_(0, order, sorted);
  return unsorted.view({tokens, k, sorted.size(1)}).sum(1);
}

at::Tensor GroupedForward(const at::Tensor& x, const BlockWeights& w, const ModelConfig& config,
                          const std::vector<MoeJob>& jobs, const at::Tensor& index,
                          const at::Tensor& weights, MoeTape* tape) {
  const int64_t n = x.size(0), k = index.size(1), experts = config.num_experts;
  const int64_t groups_per_expert = static_cast<int64_t>(jobs.size());
  // Each routed slot's group: expert * J + job.
  at::Tensor key = index * groups_per_expert;
  if (groups_per_expert > 1) {
    std::vector<at::Tensor> job_of_row;
    for (size_t j = 0; j < jobs.size(); ++j)
      job_of_row.push_back(at::full({jobs[j].rows}, static_cast<int64_t>(j), index.options()));
    key = key + at::cat(job_of_row).unsqueeze(1);
  }
  const at::Tensor flat = key.reshape({-1});
  const at::Tensor order = std::get<1>(flat.sort(/*stable=*/true, 0, /*descending=*/false));
  const at::Tensor tokens = at::floor_divide(order, k);
  // Slots per group, without waiting for the device (at::bincount reads its input's range on
  // the host): a CUDA graph may capture the pass.
  const at::Tensor counts = at::zeros({experts * groups_per_expert}, flat.options())
                                .index_add_(0, flat, at::ones_like(flat));
  const at::Tensor group_ends = counts.cumsum(0).to(at::kInt);
  const at::Tensor expert_ends =
      counts.view({experts, groups_per_expert}).sum(1).cumsum(0).to(at::kInt);

  const at::Tensor xs = x.index_select(0, tokens);  // [M, H]
  std::array<at::Tensor, 3> u;
  auto project = [&](const at::Tensor& in, int proj) {
    const at::Tensor stacked = StackedExperts(w, proj);  // [E, out, in]
    at::Tensor y = GroupedMm(in, stacked.transpose(1, 2), expert_ends);
    const StackedLowRank lr =
        StackLowRank(jobs, experts, proj, stacked.size(2), stacked.size(1), in.options());
    if (lr.rank > 0) {
      u[static_cast<size_t>(proj)] = GroupedMm(in, lr.a.transpose(1, 2), group_ends);
      y.add_(GroupedMm(u[static_cast<size_t>(proj)], lr.b.transpose(1, 2), group_ends));
    }
    return y;
  };
  at::Tensor gate = project(xs, 0);
  at::Tensor up = project(xs, 1);
  at::Tensor z = SwiGlu(gate, up);
  at::Tensor d = project(z, 2);
  const at::Tensor y = d * weights.index_select(0, order).unsqueeze(1);
  if (tape) {
    tape->grouped = true;
    tape->g = {order, tokens, expert_ends, group_ends, gate, up, z, d, u};
  }
  return SumPerToken(y, order, n, k);
}

// The backward of one projection's low-rank terms over the groups: the jobs' A and B
// gradients (f32, views of one stacked tensor each) and the input gradient's term.
void GroupedBackLowRank(const at::Tensor& dy, const at::Tensor& in, at::Tensor& din, int proj,
                        const at::Tensor& u, const at::Tensor& group_ends,
                        const std::vector<MoeJob>& jobs, int64_t experts,
                        std::vector<LoraBlock>& grads) {
  if (!u.defined()) return;
  const StackedLowRank lr = StackLowRank(jobs, experts, proj, in.size(1), dy.size(1), dy.options());
  const at::Tensor g = GroupedMm(dy, lr.b, group_ends);  // [M, r]: dy (s B)
  // A group no slot reached has no gradient: zeros, whatever the kernel left there.
  const at::Tensor reached =
      (at::diff(group_ends, 1, 0, at::zeros({1}, group_ends.options())) > 0).view({-1, 1, 1});
  const at::Tensor zero = at::zeros({}, dy.options().dtype(at::kFloat));
  const at::Tensor da =
      at::where(reached, GroupedMm(g.t(), in, group_ends).to(at::kFloat), zero);  // [G, r, in]
  const at::Tensor dbs =
      at::where(reached, GroupedMm(dy.t(), u, group_ends).to(at::kFloat), zero);  // [G, out, r]
  din.add_(GroupedMm(g, lr.a, group_ends));
  ScaleByJob(dbs, jobs, experts);  // dL/dB = s dL/d(s B)
  const int64_t per_expert = static_cast<int64_t>(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j)
    for (int64_t e = 0; e < experts; ++e) {
      const at::Tensor* a = ExpertA(jobs[j], e, proj);
      if (!a) continue;
      const int64_t gi = e * per_expert + static_cast<int64_t>(j);
      ExpertLora& out = grads[j].experts[static_cast<size_t>(e)];
      out.a[proj] = da[gi].narrow(0, 0, a->size(0));
      out.b[proj] = dbs[gi].narrow(1, 0, a->size(0));
    }
}

at::Tensor GroupedBackward(MoeTape& tape, const at::Tensor& x, const BlockWeights& w,
                           const std::vector<MoeJob>& jobs, const at::Tensor& dy,
                           at::Tensor& dweights, std::vector<LoraBlock>& grads) {
  MoeTape::Grouped& t = tape.g;
  const int64_t n = x.size(0), k = tape.chosen.size(1);
  const int64_t experts = static_cast<int64_t>(w.experts.size());
  const at::Tensor dyt = dy.index_select(0, t.tokens);  // [M, H]
  dweights.index_copy_(0, t.order, (dyt * t.d).sum(1).to(at::kFloat));
  const at::Tensor dd = dyt * tape.weights.index_select(0, t.order).unsqueeze(1);
  at::Tensor dz = GroupedMm(dd, StackedExperts(w, 2), t.expert_ends);
  GroupedBackLowRank(dd, t.z, dz, 2, t.u[2], t.group_ends, jobs, experts, grads);
  t.d = t.z = at::Tensor();
  auto [dgate, dup] = SwiGluBackward(dz, t.gate, t.up);
  t.gate = t.up = dz = at::Tensor();
  const at::Tensor xs = x.index_select(0, t.tokens);
  at::Tensor dxs = GroupedMm(dgate, StackedExperts(w, 0), t.expert_ends)
                       .add_(GroupedMm(dup, StackedExperts(w, 1), t.expert_ends));
  GroupedBackLowRank(dgate, xs, dxs, 0, t.u[0], t.group_ends, jobs, experts, grads);
  GroupedBackLowRank(dup, xs, dxs, 1, t.u[1], t.group_ends, jobs, experts, grads);
  return SumPerToken(dxs, t.order, n, k);
}
#endif

bool UseGrouped(const at::Tensor& x, const ModelConfig& config, bool per_job_gemms,
                MoeGemms gemms) {
  if (gemms == MoeGemms::kPerExpert) return false;
  const bool available = GroupedMoeAvailable(config, x.device(), x.scalar_type()) && !per_job_gemms;
  if (gemms == MoeGemms::kGrouped && !available)
    throw Error(ErrorCode::kUnsupported,
                "grouped expert GEMMs need CUDA, bf16, LibTorch 2.9 or later, widths that are "
                "multiples of 8, and one GEMM over every job's tokens");
  return available;
}

}  // namespace

bool GroupedMoeAvailable(const c10::Device& device, c10::ScalarType dtype) {
  return LORASTREAM_GROUPED_MM && device.is_cuda() && dtype == at::kBFloat16;
}

bool GroupedMoeAvailable(const at::Tensor& x) {
  return GroupedMoeAvailable(x.device(), x.scalar_type());
}

bool GroupedMoeAvailable(const ModelConfig& config, const c10::Device& device,
                         c10::ScalarType dtype) {
  // Rows of 16-byte multiples for at::_grouped_mm.
  return GroupedMoeAvailable(device, dtype) && config.hidden_size % 8 == 0 &&
         config.moe_intermediate_size % 8 == 0;
}

at::Tensor MoeForward(const at::Tensor& x, const BlockWeights& w, const ModelConfig& config,
                      const std::vector<MoeJob>& jobs, bool per_job_gemms, MoeTape* tape,
                      MoeGemms gemms) {
  CheckWeights(w, config);
  // Grouped where it runs, for a taped pass or one without autograd (the reference path, an
  // untaped pass under grad mode, is autograd's over per-expert GEMMs).
  const bool grouped =
      UseGrouped(x, config, per_job_gemms, gemms) && (tape || !at::GradMode::is_enabled());
  const int64_t n = x.size(0), k = config.num_experts_per_tok;
  const std::vector<Segment> segments = Segments(jobs, per_job_gemms, n);
  const at::Tensor logits = SegmentedMm(x, w.router, segments);  // [N, E]

  // The router: softmax over all experts in f32, the top k, renormalised when configured.
  at::Tensor chosen, index;
  if (tape) {
    c10::AutoGradMode grad(true);  // a [N, E] graph for the routing weights' backward
    tape->logits = logits.detach().to(at::kFloat).requires_grad_(true);
    const at::Tensor probs = at::softmax(tape->logits, -1);
    index = std::get<1>(probs.detach().topk(k, -1));
    chosen = probs.gather(1, index);
    if (config.norm_topk_prob) chosen = chosen / chosen.sum(-1, true);
    tape->chosen = chosen;
    chosen = chosen.detach();
  } else {
    const at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
    auto top = probs.topk(k, -1);
    chosen = std::get<0>(top);
    index = std::get<1>(top);
    if (config.norm_topk_prob) chosen = chosen / chosen.sum(-1, true);
  }
  const at::Tensor weights = chosen.to(x.scalar_type()).reshape({-1});  // [N * k]
  if (tape) tape->weights = weights;
#if LORASTREAM_GROUPED_MM
  if (grouped) return GroupedForward(x, w, config, jobs, index, weights, tape);
#else
  (void)grouped;
#endif

  const at::Tensor host = index.to(at::kCPU).contiguous();
  const int64_t* chosen_expert = host.data_ptr<int64_t>();
  const auto ids = at::TensorOptions().dtype(at::kLong);
  at::Tensor out = at::zeros_like(x);
  for (const Segment& seg : segments) {
    // Each expert's tokens of the segment in row order, and their slots.
    std::vector<std::vector<int64_t>> tokens(static_cast<size_t>(config.num_experts)),
        slots(static_cast<size_t>(config.num_experts));
    for (int64_t t = seg.begin; t < seg.end; ++t)
      for (int64_t s = 0; s < k; ++s) {
        const int64_t e = chosen_expert[t * k + s];
        LS_CHECK(e >= 0 && e < config.num_experts, "router index");
        tokens[static_cast<size_t>(e)].push_back(t);
        slots[static_cast<size_t>(e)].push_back(s);
      }
    for (int64_t e = 0; e < config.num_experts; ++e) {
      const std::vector<int64_t>& tok = tokens[static_cast<size_t>(e)];
      if (tok.empty()) continue;
      const int64_t count = static_cast<int64_t>(tok.size());
      MoeTape::Run run;
      run.expert = e;
      run.tokens =
          at::from_blob(const_cast<int64_t*>(tok.data()), {count}, ids).clone().to(x.device());
      run.slots =
          at::from_blob(slots[static_cast<size_t>(e)].data(), {count}, ids).clone().to(x.device());
      for (size_t j = 0; j < jobs.size(); ++j) {
        const MoeJob& job = jobs[j];
        const auto first = std::lower_bound(tok.begin(), tok.end(), job.offset);
        const auto last = std::lower_bound(tok.begin(), tok.end(), job.offset + job.rows);
        if (first == last) continue;
        MoeTape::Run::Part part;
        part.job = j;
        part.begin = first - tok.begin();
        part.count = last - first;
        run.parts.push_back(part);
      }
      const auto& we = w.experts[static_cast<size_t>(e)];
      const at::Tensor xe = x.index_select(0, run.tokens);
      at::Tensor gate = at::mm(xe, we[0].t());
      at::Tensor up = at::mm(xe, we[1].t());
      AddLowRank(xe, gate, 0, e, jobs, run.parts);
      AddLowRank(xe, up, 1, e, jobs, run.parts);
      const at::Tensor z = SwiGlu(gate, up);
      at::Tensor d = at::mm(z, we[2].t());
      AddLowRank(z, d, 2, e, jobs, run.parts);
      const at::Tensor wv = weights.index_select(0, run.tokens * k + run.slots);
      const at::Tensor y = d * wv.unsqueeze(1);
      if (tape) {
        out.index_add_(0, run.tokens, y);
        run.gate = gate;
        run.up = up;
        run.z = z;
        run.d = d;
        tape->runs.push_back(std::move(run));
      } else {
        out = out.index_add(0, run.tokens, y);
      }
    }
  }
  return out;
}

at::Tensor MoeBackward(MoeTape& tape, const at::Tensor& x, const BlockWeights& w,
                       const std::vector<MoeJob>& jobs, bool per_job_gemms, const at::Tensor& dy,
                       std::vector<LoraBlock>& grads) {
  LS_CHECK(tape.chosen.defined(), "MoeBackward needs the tape of a taped MoeForward");
  const int64_t n = x.size(0), k = tape.chosen.size(1);
  // Every adapted expert's gradients, zeros where no token of the job reached the expert.
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!jobs[j].lora) continue;
    const auto& experts = jobs[j].lora->experts;
    grads[j].experts.resize(experts.size());
    if (tape.grouped) continue;  // the grouped backward writes every one (zeros included)
    for (size_t e = 0; e < experts.size(); ++e)
      for (int p = 0; p < 3; ++p)
        if (experts[e].a[p].defined()) {
          grads[j].experts[e].a[p] =
              at::zeros(experts[e].a[p].sizes(), experts[e].a[p].options().dtype(at::kFloat));
          grads[j].experts[e].b[p] =
              at::zeros(experts[e].b[p].sizes(), experts[e].b[p].options().dtype(at::kFloat));
        }
  }
  at::Tensor dx = at::zeros_like(x);
  at::Tensor dweights = at::zeros({n * k}, dy.options().dtype(at::kFloat));
#if LORASTREAM_GROUPED_MM
  if (tape.grouped) dx = GroupedBackward(tape, x, w, jobs, dy, dweights, grads);
#endif
  for (MoeTape::Run& run : tape.runs) {
    const auto& we = w.experts[static_cast<size_t>(run.expert)];
    const at::Tensor flat = run.tokens * k + run.slots;
    const at::Tensor dyt = dy.index_select(0, run.tokens);
    dweights.index_copy_(0, flat, (dyt * run.d).sum(1).to(at::kFloat));
    const at::Tensor dd = dyt * tape.weights.index_select(0, flat).unsqueeze(1);
    at::Tensor dz = at::mm(dd, we[2]);
    BackLowRank(dd, run.z, dz, 2, run.expert, jobs, run.parts, grads);
    run.d = run.z = at::Tensor();
    auto [dgate, dup] = SwiGluBackward(dz, run.gate, run.up);
    run.gate = run.up = dz = at::Tensor();
    const at::Tensor xe = x.index_select(0, run.tokens);
    at::Tensor dxe = at::mm(dgate, we[0]).addmm_(dup, we[1]);
    BackLowRank(dgate, xe, dxe, 0, run.expert, jobs, run.parts, grads);
    BackLowRank(dup, xe, dxe, 1, run.expert, jobs, run.parts, grads);
    dx.index_add_(0, run.tokens, dxe);
  }
  // The routing weights' gradient through the renormalisation and the softmax, then the
  // router's input gradient (its weight is frozen).
  const at::Tensor dlogits =
      torch::autograd::grad({tape.chosen}, {tape.logits}, {dweights.view({n, k})},
                            /*retain_graph=*/false, /*create_graph=*/false)[0]
          .to(dy.scalar_type());
  for (const Segment& s : Segments(jobs, per_job_gemms, n))
    dx.narrow(0, s.begin, s.end - s.begin)
        .addmm_(dlogits.narrow(0, s.begin, s.end - s.begin), w.router);
  tape = MoeTape{};
  return dx;
}

}  // namespace lorastream::worker
