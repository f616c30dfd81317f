// The grouped expert GEMMs (worker/model/moe_mlp.h, MoeGemms::kGrouped: at::_grouped_mm over
// every expert at once) against the per-expert GEMMs on the same CUDA bf16 inputs: a group of
// two jobs of different ranks, scales and targets (one adapting every projection of every
// expert, one only the gates and ups), some experts reached by no token. Output, input
// gradient and every expert LoRA gradient agree to bf16's rounding; the grouped pass gives
// the same bits run twice (a recompute equals its forward) and taped or not; experts held as
// views of one buffer (the store's layout) and as separate tensors give the same bits.
#include "tests/worker/torch_catch.h"  // first: see there

#include <array>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/formats/model_config.h"
#include "worker/model/block_weights.h"
#include "worker/model/lora.h"
#include "worker/model/moe_mlp.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

double Relative(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kFloat), w = want.to(at::kFloat);
  return (g - w).abs().max().item<double>() / std::max(w.abs().max().item<double>(), 1e-30);
}

struct Pass {
  at::Tensor y, dx;
  std::vector<LoraBlock> grads;
};

Pass Run(const at::Tensor& x, const at::Tensor& dy, const BlockWeights& w, const ModelConfig& c,
         const std::vector<MoeJob>& jobs, MoeGemms gemms) {
  c10::NoGradGuard no_grad;
  Pass p;
  MoeTape tape;
  p.y = MoeForward(x, w, c, jobs, false, &tape, gemms);
  p.grads.resize(jobs.size());
  p.dx = MoeBackward(tape, x, w, jobs, false, dy, p.grads);
  return p;
}

}  // namespace

TEST_CASE("CUDA: grouped expert GEMMs equal the per-expert GEMMs to bf16 rounding", "[gpu]") {
  const at::Device cuda(at::kCUDA, 0);
  REQUIRE(GroupedMoeAvailable(at::zeros({1}, at::TensorOptions(cuda).dtype(at::kBFloat16))));
  at::manual_seed(11);
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.hidden_size = 64;
  c.num_experts = 12;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 48;
  c.norm_topk_prob = true;
  const int64_t h = c.hidden_size, inter = c.moe_intermediate_size, e_count = c.num_experts;
  const auto bf16 = at::TensorOptions(cuda).dtype(at::kBFloat16);

  // The experts as the store lays them out: one buffer, expert by expert, gate, up, down.
  const at::Tensor buffer = at::randn({e_count * 3 * inter * h}, bf16) * 0.1;
  BlockWeights packed;
  // Inputs of a positive mean and a router whose last three experts score -0.5 x their sum:
  // no token reaches those.
  packed.router = at::randn({e_count, h}, bf16);
  packed.router.narrow(0, e_count - 3, 3).fill_(-0.5);
  for (int64_t e = 0; e < e_count; ++e) {
    std::array<at::Tensor, 3> t;
    for (int p = 0; p < 3; ++p) {
      const int64_t at_ = (e * 3 + p) * inter * h;
      t[static_cast<size_t>(p)] =
          buffer.narrow(0, at_, inter * h)
              .view(p == 2 ? std::vector<int64_t>{h, inter} : std::vector<int64_t>{inter, h});
    }
    packed.experts.push_back(t);
  }
  BlockWeights separate = packed;  // the same values, each its own allocation
  for (auto& t : separate.experts)
    for (at::Tensor& p : t) p = p.clone();

  // Job 0: rank 8 on every projection of every expert; job 1: rank 16, gate and up only.
  std::vector<LoraBlock> loras(2);
  for (size_t j = 0; j < 2; ++j) {
    loras[j].experts.resize(static_cast<size_t>(e_count));
    const int64_t r = j == 0 ? 8 : 16;
    for (int64_t e = 0; e < e_count; ++e)
      for (int p = 0; p < (j == 0 ? 3 : 2); ++p) {
        const int64_t in = p == 2 ? inter : h, out = p == 2 ? h : inter;
        loras[j].experts[static_cast<size_t>(e)].a[p] = at::randn({r, in}, bf16) * 0.1;
        loras[j].experts[static_cast<size_t>(e)].b[p] = at::randn({out, r}, bf16) * 0.1;
      }
  }
  const std::vector<MoeJob> jobs = {{0, 40, &loras[0], 2.0}, {40, 24, &loras[1], 0.5}};
  const at::Tensor x = at::randn({64, h}, bf16) + 1.0, dy = at::randn({64, h}, bf16);

  const Pass ref = Run(x, dy, packed, c, jobs, MoeGemms::kPerExpert);
  const Pass got = Run(x, dy, packed, c, jobs, MoeGemms::kGrouped);
  CHECK(Relative(got.y, ref.y) < 2e-2);
  CHECK(Relative(got.dx, ref.dx) < 2e-2);
  int reached = 0, unreached = 0;
  for (size_t j = 0; j < 2; ++j)
    for (int64_t e = 0; e < e_count; ++e)
      for (int p = 0; p < 3; ++p) {
        const at::Tensor& want = ref.grads[j].experts[static_cast<size_t>(e)].a[p];
        if (!want.defined()) {
          CHECK_FALSE(got.grads[j].experts[static_cast<size_t>(e)].a[p].defined());
          continue;
        }
        INFO("job " << j << " expert " << e << " projection " << p);
        for (bool is_a : {true, false}) {
          const at::Tensor& w = is_a ? want : ref.grads[j].experts[static_cast<size_t>(e)].b[p];
          const at::Tensor& g = is_a ? got.grads[j].experts[static_cast<size_t>(e)].a[p]
                                     : got.grads[j].experts[static_cast<size_t>(e)].b[p];
          REQUIRE(g.defined());
          CHECK(g.scalar_type() == at::kFloat);
          CHECK(g.sizes() == w.sizes());
          if (w.abs().max().item<double>() == 0) {
            CHECK(g.abs().max().item<double>() == 0);
            unreached += is_a;
          } else {
            CHECK(Relative(g, w) < 3e-2);
            reached += is_a;
          }
        }
      }
  CHECK(reached > 0);
  CHECK(unreached > 0);  // the biased router left some experts without tokens

  // Deterministic: a second pass (the checkpointed recompute) gives the same bits, and so do
  // the experts as separate tensors (stacked) and an untaped pass without autograd.
  const Pass again = Run(x, dy, packed, c, jobs, MoeGemms::kGrouped);
  CHECK(at::equal(again.y, got.y));
  CHECK(at::equal(again.dx, got.dx));
  const Pass apart = Run(x, dy, separate, c, jobs, MoeGemms::kGrouped);
  CHECK(at::equal(apart.y, got.y));
  CHECK(at::equal(apart.dx, got.dx));
  {
    c10::NoGradGuard no_grad;
    CHECK(at::equal(MoeForward(x, packed, c, jobs, false, nullptr, MoeGemms::kGrouped), got.y));
  }
  // kAuto takes the grouped GEMMs here.
  CHECK(at::equal(Run(x, dy, packed, c, jobs, MoeGemms::kAuto).y, got.y));

  // Jobs whose experts' factors come stacked (LoraBlockCast::experts_a/b, as a training step
  // hands them over) give the bits of the same factors one by one: alone, and two jobs of one
  // rank at different scales.
  std::array<at::Tensor, 3> stacked_a, stacked_b;
  for (int p = 0; p < 3; ++p) {
    std::vector<at::Tensor> as, bs;
    for (const ExpertLora& e : loras[0].experts) {
      as.push_back(e.a[p]);
      bs.push_back(e.b[p]);
    }
    stacked_a[static_cast<size_t>(p)] = at::stack(as);
    stacked_b[static_cast<size_t>(p)] = at::stack(bs);
  }
  LoraBlock views;  // loras[0] as views of the stacks, as CastLoraBlock makes them
  views.experts.resize(static_cast<size_t>(e_count));
  for (int64_t e = 0; e < e_count; ++e)
    for (int p = 0; p < 3; ++p) {
      views.experts[static_cast<size_t>(e)].a[p] = stacked_a[static_cast<size_t>(p)][e];
      views.experts[static_cast<size_t>(e)].b[p] = stacked_b[static_cast<size_t>(p)][e];
    }
  for (const std::vector<double>& scales : {std::vector<double>{2.0}, {2.0, 0.5}}) {
    std::vector<MoeJob> loose, whole;
    int64_t offset = 0;
    for (double scale : scales) {
      const int64_t rows = scales.size() == 1 ? 64 : 32;
      loose.push_back({offset, rows, &loras[0], scale});
      whole.push_back({offset, rows, &views, scale, stacked_a, stacked_b});
      offset += rows;
    }
    INFO(scales.size() << " job(s)");
    const Pass a = Run(x, dy, packed, c, loose, MoeGemms::kGrouped);
    const Pass b = Run(x, dy, packed, c, whole, MoeGemms::kGrouped);
    CHECK(at::equal(a.y, b.y));
    CHECK(at::equal(a.dx, b.dx));
    for (size_t j = 0; j < scales.size(); ++j)
      for (int64_t e = 0; e < e_count; ++e)
        for (int p = 0; p < 3; ++p) {
          CHECK(at::equal(a.grads[j].experts[static_cast<size_t>(e)].a[p],
                          b.grads[j].experts[static_cast<size_t>(e)].a[p]));
          CHECK(at::equal(a.grads[j].experts[static_cast<size_t>(e)].b[p],
                          b.grads[j].experts[static_cast<size_t>(e)].b[p]));
        }
  }
}
