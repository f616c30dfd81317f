// The model and its checkpointed blocks: the hand-written block backward (worker/model/block.h)
// equals autograd through the same forward (in f64 at the block: to the f32 rounding of
// RMSNorm, which runs in f32 as transformers'; in f32 through the whole model), and blocks are
// acquired in the step's order.

#include "torch_catch.h"  // first: see there

#include <set>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "common/base/error.h"
#include "worker/model/base_weights.h"
#include "worker/model/block.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/stream/stream_budget.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

struct Grads {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
  std::vector<int> order;
};

Grads RunOnce(const BaseWeights& base, const LoraSettings& settings, bool checkpointed,
              const at::Tensor& ids, int taped_blocks = 0) {
  ResidentProvider provider(base, at::kCPU, at::kFloat);
  provider.set_record_acquires(true);
  provider.set_taped_blocks(taped_blocks);
  CausalLm model(base.config(), base.rest(), &provider, at::kCPU, at::kFloat);
  LoraAdapter adapter = LoraAdapter::Init(base.config(), settings, 11, at::kCPU);
  {
    // Non-zero B so that every gradient path carries signal.
    c10::NoGradGuard no_grad;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    for (auto& p : adapter.Params()) p.uniform_(-0.1, 0.1, gen);
  }
  at::Tensor targets =
      at::cat({ids.narrow(1, 1, ids.size(1) - 1), at::full({ids.size(0), 1}, -100, at::kLong)}, 1);
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

namespace {

// max |a - b| relative to max |b|: a scale-free distance for gradients of any size.
double RelativeDistance(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

LoraSettings SettingsWith(std::initializer_list<int> targets, double dropout) {
  LoraSettings s;
  s.rank = 4;
  s.alpha = 8;
  s.dropout = dropout;
  for (int t : targets) s.targets[t] = true;
  return s;
}

LoraSettings AllTargets(double dropout) {
  return SettingsWith({kQProj, kKProj, kVProj, kOProj, kGateProj, kUpProj, kDownProj}, dropout);
}

}  // namespace

TEST_CASE("the hand-written block backward equals autograd through the same forward (f64)",
          "[worker]") {
  const std::initializer_list<int> all = {kQProj,    kKProj,  kVProj,   kOProj,
                                          kGateProj, kUpProj, kDownProj};
  const std::initializer_list<int> some = {kVProj, kUpProj, kDownProj};
  for (const char* preset : {"tiny", "tiny-qwen2", "tiny-qwen3"}) {
    for (double dropout : {0.0, 0.1}) {
      for (bool subset : {false, true}) {
        DYNAMIC_SECTION(preset << " dropout " << dropout << (subset ? " some targets" : "")) {
          testing::TempDir dir("block");
          BaseWeights base =
              BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
          const ModelConfig& cfg = base.config();
          ResidentProvider provider(base, at::kCPU, at::kDouble);
          LoraAdapter adapter =
              LoraAdapter::Init(cfg, SettingsWith(subset ? some : all, dropout), 11, at::kCPU);
          LoraBlock lora = adapter.block(1);
          at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
          std::vector<at::Tensor> leaves;
          for (int t = 0; t < kNumLoraTargets; ++t) {
            if (!lora.a[t].defined()) continue;
            // Non-zero B so that every gradient path carries signal.
            lora.a[t] = at::empty_like(lora.a[t], at::kDouble).uniform_(-0.3, 0.3, gen);
            lora.b[t] = at::empty_like(lora.b[t], at::kDouble).uniform_(-0.3, 0.3, gen);
            leaves.push_back(lora.a[t].requires_grad_(true));
            leaves.push_back(lora.b[t].requires_grad_(true));
          }
          RotaryTables rope = BuildRotary(cfg, 24, at::kCPU, at::kDouble);
          BlockCompute c;
          c.config = &cfg;
          c.rope = &rope;
          c.lora_scale = 2.0;
          c.dropout = dropout;
          c.training = true;
          c.dropout_seed = 77;
          at::Tensor x = at::randn({2, 24, cfg.hidden_size}, gen, at::kDouble);
          at::Tensor dy = at::randn({2, 24, cfg.hidden_size}, gen, at::kDouble);
          provider.BeginStep();
          const BlockWeights& w = provider.Acquire(1);

          at::Tensor xr = x.clone().requires_grad_(true);
          at::Tensor y = BlockForward(xr, w, lora, c);
          std::vector<at::Tensor> inputs{xr};
          inputs.insert(inputs.end(), leaves.begin(), leaves.end());
          auto want = torch::autograd::grad({y}, inputs, {dy});

          BlockTape tape;
          const LoraBlockCast cast = CastLoraBlock(lora, at::kDouble);
          at::Tensor yt = BlockForwardTaped(x, w, cast, c, &tape);
          CHECK(at::equal(yt, y.detach()));
          LoraBlockGrads grads;
          at::Tensor dx = BlockBackward(tape, w, cast, c, dy, /*need_dx=*/true, grads);
          provider.Release(1);
          CHECK_FALSE(tape.x.defined());  // the tape is consumed
          // RMSNorm runs in f32 whatever the dtype (as transformers'), and the two sides
          // take its sums in another order: f32 rounding, not f64's.
          CHECK(RelativeDistance(dx, want[0]) < 1e-6);
          size_t k = 1;
          for (int t = 0; t < kNumLoraTargets; ++t) {
            if (!lora.a[t].defined()) {
              CHECK_FALSE(grads.a[t].defined());
              continue;
            }
            INFO(LoraTargetName(t));
            REQUIRE(grads.a[t].scalar_type() == at::kFloat);
            CHECK(grads.a[t].abs().sum().item<double>() > 0);
            CHECK(grads.b[t].abs().sum().item<double>() > 0);
            // The gradients come back in f32, the adapter's master dtype.
            CHECK(RelativeDistance(grads.a[t].to(at::kDouble), want[k++]) < 1e-6);
            CHECK(RelativeDistance(grads.b[t].to(at::kDouble), want[k++]) < 1e-6);
          }
        }
      }
    }
  }
}

TEST_CASE("checkpointed blocks give the loss of plain autograd and its gradients to f32 rounding",
          "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen2", "tiny-qwen3"}) {
    for (double dropout : {0.0, 0.1}) {
      DYNAMIC_SECTION(preset << " dropout " << dropout) {
        testing::TempDir dir("ckpt");
        BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
        const LoraSettings s = AllTargets(dropout);
        at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 24}, at::kLong);
        Grads plain = RunOnce(base, s, false, ids);
        Grads ckpt = RunOnce(base, s, true, ids);
        CHECK(at::equal(plain.loss, ckpt.loss));
        REQUIRE(plain.grads.size() == ckpt.grads.size());
        for (size_t i = 0; i < plain.grads.size(); ++i) {
          INFO("parameter " << i);
          CHECK(RelativeDistance(ckpt.grads[i], plain.grads[i]) < 1e-5);
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

TEST_CASE("taped blocks skip their recompute and give the same loss and gradients, bit for bit",
          "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen3"}) {
    for (double dropout : {0.0, 0.1}) {
      DYNAMIC_SECTION(preset << " dropout " << dropout) {
        testing::TempDir dir("taped");
        BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
        const LoraSettings s = AllTargets(dropout);
        at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 24}, at::kLong);
        const Grads recomputed = RunOnce(base, s, true, ids);
        const int L = base.num_blocks();
        for (int taped : {1, 2, L}) {
          INFO(taped << " taped blocks");
          const Grads g = RunOnce(base, s, true, ids, taped);
          CHECK(at::equal(g.loss, recomputed.loss));
          REQUIRE(g.grads.size() == recomputed.grads.size());
          for (size_t i = 0; i < g.grads.size(); ++i)
            CHECK(at::equal(g.grads[i], recomputed.grads[i]));
          // The backward still acquires every block (its weights are read), in the step's order.
          CHECK(g.order == recomputed.order);
        }
      }
    }
  }
}

TEST_CASE("the memory estimate's tape covers what a taped block keeps", "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen3"}) {
    for (double dropout : {0.0, 0.1}) {
      DYNAMIC_SECTION(preset << " dropout " << dropout) {
        testing::TempDir dir("tape");
        BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
        const ModelConfig& cfg = base.config();
        ResidentProvider provider(base, at::kCPU, at::kFloat);
        LoraAdapter adapter = LoraAdapter::Init(cfg, AllTargets(dropout), 11, at::kCPU);
        const int64_t batch = 2, seq = 24;
        RotaryTables rope = BuildRotary(cfg, seq, at::kCPU, at::kFloat);
        BlockCompute c;
        c.config = &cfg;
        c.rope = &rope;
        c.lora_scale = 2.0;
        c.dropout = dropout;
        c.training = true;
        at::Tensor x = at::randn({batch, seq, cfg.hidden_size});
        provider.BeginStep();
        BlockTape tape;
        BlockForwardTaped(x, provider.Acquire(0), CastLoraBlock(adapter.block(0), at::kFloat), c,
                          &tape);
        provider.Release(0);
        // The tape's own storages (the input is the checkpoint, counted apart).
        std::set<const void*> seen{x.storage().data()};
        uint64_t kept = 0;
        std::vector<at::Tensor> tensors = {tape.rstd_in,   tape.h1,     tape.q_pre,     tape.k_pre,
                                           tape.rstd_q,    tape.rstd_k, tape.attn_flat, tape.out,
                                           tape.rstd_post, tape.h2,     tape.gate,      tape.up,
                                           tape.z};
        for (const BlockTape::Job& j : tape.jobs) {
          tensors.insert(tensors.end(), {j.q, j.k, j.v, j.attn});
          for (const auto& a : j.lora) tensors.insert(tensors.end(), {a.u, a.xd, a.mask});
        }
        for (const at::Tensor& t : tensors) {
          if (t.defined() && seen.insert(t.storage().data()).second) kept += t.storage().nbytes();
        }
        MemoryModelInputs in;
        in.config = cfg;
        in.block_bytes.assign(cfg.num_hidden_layers, 0);
        in.tokens = batch * seq;
        in.compute_bytes = 4;
        in.lora_rank = 4;
        in.lora_dropout = dropout;
        in.attention_materialized = true;  // the CPU's attention keeps its probabilities
        const MemoryEstimate e = EstimateMemory(in, PlanFromSwapCount(cfg.num_hidden_layers, 0, 1));
        const uint64_t probabilities = cfg.num_attention_heads * in.tokens * seq * 4;
        INFO("kept " << kept << " bytes, estimate " << e.tape);
        CHECK(kept > 0);
        CHECK(kept + probabilities <= e.tape);
        CHECK(e.tape <= 2 * (kept + probabilities));
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
