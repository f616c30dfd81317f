// FLUX.1 on CUDA, where joint attention's per-head RMSNorm and rotary embedding run as fused
// kernels (worker/model/dit_ops.cc), gives the CPU's ATen arithmetic: flux-tiny in f32, one
// checkpointed forward and backward, the loss and every LoRA gradient within f32 rounding.
#include <c10/core/GradMode.h>
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "common/formats/flux_config.h"
#include "common/job/step_stats.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_model.h"
#include "worker/flux/flux_objective.h"
#include "worker/model/fused_ops.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;

namespace {

struct Result {
  double loss = 0;
  std::vector<at::Tensor> grads;  // on the CPU
};

// flux-tiny resident on `device` in f32, an adapter on every linear layer (B random, so that
// A gets a gradient), two 32x48-pixel images with 8 text tokens; the same seeds on every device.
Result LossAndGrads(const std::string& checkpoint, c10::Device device) {
  FluxBase base = FluxBase::Load(checkpoint, 2, at::kFloat, device);
  auto engine = base.MakeEngine(0, 1, device);
  FluxModel model(base.config(), base.rest(), engine.get(), 2, device, at::kFloat);
  const FluxConfig& c = base.config();
  FluxAdapter adapter(c, FluxTargets({"all"}, "test"), 4, 8.0, 11, device);
  at::Generator gen = at::detail::createCPUGenerator(5);
  {
    c10::NoGradGuard no_grad;
    for (auto& [name, m] : adapter.modules())
      m.b.copy_(at::empty(m.b.sizes()).normal_(0, 0.05, gen));
  }
  const int64_t n = 2, h = 4, w = 6, lt = 8;
  FluxBatch b;
  b.img = PackLatents(at::empty({n, 16, h, w}).normal_(0, 1, gen)).to(device);
  b.img_ids = ImageIds(n, h, w, device);
  b.txt = at::empty({n, lt, c.context_in_dim}).normal_(0, 1, gen).to(device);
  b.txt_ids = at::zeros({n, lt, 3}, at::TensorOptions(device));
  b.y = at::empty({n, c.vec_in_dim}).normal_(0, 1, gen).to(device);
  b.timesteps = at::tensor({0.3f, 0.8f}).to(device);
  b.guidance = at::full({n}, 1.0f, at::TensorOptions(device));
  const at::Tensor target = at::empty(b.img.sizes()).normal_(0, 1, gen).to(device);
  model.provider().BeginStep();
  at::Tensor loss = FlowLoss(model.Forward(b, adapter, /*checkpointed=*/true), target);
  loss.backward();
  StepStats stats;
  model.provider().EndStep(stats);
  Result r;
  r.loss = loss.item<double>();
  for (auto& p : adapter.Params()) r.grads.push_back(p.grad().to(at::kCPU));
  return r;
}

}  // namespace

TEST_CASE("flux on CUDA (fused joint-attention heads) gives the CPU's loss and gradients",
          "[gpu]") {
  REQUIRE(FusedKernelsEnabled());
  lorastream::testing::TempDir dir("flux-cuda");
  const std::string checkpoint = lorastream::testing::MakeFluxCheckpoint(dir.str() + "/model");

  const Result cpu = LossAndGrads(checkpoint, at::kCPU);
  const Result gpu = LossAndGrads(checkpoint, c10::Device(c10::kCUDA, 0));
  CHECK(std::abs(gpu.loss - cpu.loss) <= 1e-5 * std::abs(cpu.loss));
  REQUIRE(gpu.grads.size() == cpu.grads.size());
  double worst = 0;
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    REQUIRE(cpu.grads[i].abs().max().item<double>() > 0);
    worst = std::max(
        worst,
        ((gpu.grads[i] - cpu.grads[i]).abs().max() / cpu.grads[i].abs().max()).item<double>());
  }
  INFO("worst relative gradient difference " << worst);
  CHECK(worst < 1e-4);
}
