// The model and its checkpointed autograd: gradients through the checkpointed blocks are
// bit-equal to plain autograd, and blocks are acquired in the step's order.


#include "torch_catch.h"  // first: see there

#include <c10/core/GradMode.h>

#include "common/error.h"
#include "worker/base_weights.h"
#include "worker/lora.h"
#include "worker/model.h"
#include "worker/resident_provider.h"
#include "worker_test_util.h"

using namespace lorastream;

namespace {

struct Grads {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
  std::vector<int> order;
};

Grads RunOnce(const BaseWeights& base, const LoraSettings& settings, bool checkpointed,
              const at::Tensor& ids) {
  ResidentProvider provider(base, at::kCPU, at::kFloat);
  provider.set_record_acquires(true);
  CausalLm model(base.config(), base.rest(), &provider, at::kCPU, at::kFloat);
  LoraAdapter adapter = LoraAdapter::Init(base.config(), settings, 11, at::kCPU);
  {
    // Non-zero B so that every gradient path carries signal.
    c10::NoGradGuard no_grad;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    for (auto& p : adapter.Params()) p.uniform_(-0.1, 0.1, gen);
  }
  at::Tensor targets = at::cat({ids.narrow(1, 1, ids.size(1) - 1),
                                at::full({ids.size(0), 1}, -100, at::kLong)}, 1);
  provider.BeginStep();
  at::Tensor hidden = model.Hidden(ids, adapter, true, checkpointed, 99);
  at::Tensor loss = CausalLm::LossSum(model.Logits(hidden), targets) / 10.0;
  loss.backward();
  Grads g;
  g.loss = loss.detach();
  for (auto& p : adapter.Params()) g.grads.push_back(p.grad().clone());
  g.order = provider.acquire_log();
  return g;
}

}  // namespace

TEST_CASE("checkpointed blocks give gradients bit-equal to plain autograd", "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen2", "tiny-qwen3"}) {
    for (double dropout : {0.0, 0.1}) {
      DYNAMIC_SECTION(preset << " dropout " << dropout) {
        testing::TempDir dir("ckpt");
        BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
        LoraSettings s;
        s.rank = 4;
        s.alpha = 8;
        s.dropout = dropout;
        s.targets.fill(true);
        at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 24}, at::kLong);
        Grads plain = RunOnce(base, s, false, ids);
        Grads ckpt = RunOnce(base, s, true, ids);
        CHECK(at::equal(plain.loss, ckpt.loss));
        REQUIRE(plain.grads.size() == ckpt.grads.size());
        for (size_t i = 0; i < plain.grads.size(); ++i) {
          INFO("parameter " << i);
          CHECK(at::equal(plain.grads[i], ckpt.grads[i]));
          CHECK(plain.grads[i].abs().sum().item<double>() > 0);
        }
        const int L = base.num_blocks();
        std::vector<int> want;
        for (int i = 0; i < L; ++i) want.push_back(i);
        for (int i = L - 1; i >= 0; --i) want.push_back(i);
        CHECK(ckpt.order == want);
      }
    }
  }
}

TEST_CASE("RMSNorm and rotary follow transformers' formulas", "[worker]") {
  at::Tensor x = at::randn({2, 3, 8});
  at::Tensor w = at::rand({8});
  at::Tensor expect = w * (x / at::sqrt(x.pow(2).mean(-1, true) + 1e-5));
  CHECK(at::allclose(RmsNorm(x, w, 1e-5), expect, 1e-6, 1e-6));

  ModelConfig c;
  c.head_dim = 8;
  c.rope_theta = 10000.0;
  at::Tensor inv = RotaryInvFreq(c);
  CHECK(inv[0].item<float>() == 1.0f);
  CHECK(inv[1].item<float>() == Approx(1.0 / std::pow(10000.0, 2.0 / 8)).epsilon(1e-6));
  c.rope_scaling.type = "linear";
  c.rope_scaling.factor = 4.0;
  CHECK(RotaryInvFreq(c)[1].item<float>() == Approx(inv[1].item<float>() / 4).epsilon(1e-6));
  // llama3: high frequencies unchanged, low frequencies divided by the factor.
  c.head_dim = 128;
  c.rope_theta = 500000.0;
  c.rope_scaling = RopeScaling{"llama3", 8.0, 1.0, 4.0, 8192};
  at::Tensor scaled = RotaryInvFreq(c);
  c.rope_scaling = RopeScaling{};
  at::Tensor plain = RotaryInvFreq(c);
  CHECK(scaled[0].item<float>() == plain[0].item<float>());
  CHECK(scaled[63].item<float>() == Approx(plain[63].item<float>() / 8).epsilon(1e-6));
  RotaryTables rt = BuildRotary(c, 5, at::kCPU, at::kFloat);
  CHECK(rt.cos.sizes() == at::IntArrayRef({5, 128}));
  CHECK(rt.cos[0].eq(1).all().item<bool>());
}
