#include "worker/model/moe_mlp.h"

#include <algorithm>
#include <string>

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/error.h"
#include "worker/model/fused_ops.h"

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

}  // namespace

at::Tensor MoeForward(const at::Tensor& x, const BlockWeights& w, const ModelConfig& config,
                      const std::vector<MoeJob>& jobs, bool per_job_gemms, MoeTape* tape) {
  CheckWeights(w, config);
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
