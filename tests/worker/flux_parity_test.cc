// FLUX parity against diffusers' FluxTransformer2DModel with peft LoRA (v0.39.0, f32, CPU)
// on the fixtures in tests/fixtures/flux/, made on a machine with torch and peft by
//   git -C DIFFUSERS_CLONE archive v0.39.0 src/diffusers | tar -x -C .diffusers
//   PYTHONPATH=.diffusers/src python3 tools/parity/flux_fixtures.py --out tests/fixtures/flux
// and committed. Without them the test says so (a warning naming that command) and checks
// nothing. Our model reads the BFL-named conversion of diffusers' weights, takes the same LoRA (A
// shared by the parts of a fused BFL projection, B their rows stacked) and the same inputs; output,
// loss and every LoRA gradient must agree within 1e-4 relative, resident and streamed, and
// the diffusers-format export must carry peft's keys and values.
#include "tests/worker/torch_catch.h"

#include <c10/core/GradMode.h>

#include <filesystem>

#include "common/formats/safetensors.h"
#include "tests/support/test_support.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_model.h"
#include "worker/flux/flux_objective.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;
using lorastream::testing::TempDir;

namespace {

const std::string kFixtures = std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/flux/";

at::Tensor Get(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsEntry* e = f.Find(name);
  if (e == nullptr) throw std::runtime_error(f.path() + ": no tensor " + name);
  REQUIRE(e->dtype == DType::kF32);
  return at::from_blob(const_cast<uint8_t*>(f.Data(*e)), e->shape, at::kFloat).clone();
}

double RelErr(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item<double>();
}

}  // namespace

TEST_CASE("flux parity: output, loss and LoRA gradients equal diffusers + peft (f32)",
          "[worker][flux][parity]") {
  if (!std::filesystem::exists(kFixtures + "flux_fixtures.json")) {
    WARN("FLUX parity fixtures are absent (" + kFixtures +
         "flux_fixtures.json): nothing compared. Make them with `PYTHONPATH=.diffusers/src "
         "python3 tools/parity/flux_fixtures.py --out tests/fixtures/flux` (diffusers v0.39.0, "
         "torch, peft) and commit them.");
    return;
  }
  for (const std::string name : {"flux_d1s2", "flux_d3s5"}) {
    INFO(name);
    const FluxBase base =
        FluxBase::Load(kFixtures + name + "_model.safetensors", 2, at::kFloat, at::kCPU);
    const SafetensorsFile c = SafetensorsFile::Open(kFixtures + name + "_case.safetensors");
    FluxAdapter adapter(base.config(), FluxTargets({"all"}, "test"), 4, 8.0, 0, at::kCPU);
    {
      c10::NoGradGuard no_grad;
      for (auto& [module, m] : adapter.modules()) {
        m.a.copy_(Get(c, module + ".lora_A"));
        m.b.copy_(Get(c, module + ".lora_B"));
      }
    }
    const int units = static_cast<int>(base.layouts().size());
    for (int swap : {0, units}) {  // resident, and every unit streamed
      auto engine = base.MakeEngine(swap, 1, at::kCPU);
      FluxModel model(base.config(), base.rest(), engine.get(), 2, at::kCPU, at::kFloat);
      FluxBatch b;
      b.img = Get(c, "img");
      b.txt = Get(c, "txt");
      b.y = Get(c, "y");
      b.img_ids = Get(c, "img_ids");
      b.txt_ids = Get(c, "txt_ids");
      b.timesteps = Get(c, "timesteps");
      b.guidance = Get(c, "guidance");
      for (auto& p : adapter.Params())
        if (p.grad().defined()) p.mutable_grad().zero_();
      engine->BeginStep();
      const at::Tensor out = model.Forward(b, adapter, /*checkpointed=*/true);
      const at::Tensor loss = FlowLoss(out, Get(c, "target"));
      loss.backward();
      StepStats stats;
      engine->EndStep(stats);
      CHECK(RelErr(out.detach(), Get(c, "output")) <= 1e-4);
      CHECK(RelErr(loss.detach().reshape({1}), Get(c, "loss")) <= 1e-4);
      double worst = 0;
      std::string worst_name;
      for (const auto& [module, m] : adapter.modules()) {
        for (const auto& [grad, key] : {std::pair{m.a.grad(), module + ".grad_A"},
                                        std::pair{m.b.grad(), module + ".grad_B"}}) {
          const double e = RelErr(grad, Get(c, key));
          if (e > worst) worst = e, worst_name = key;
        }
      }
      INFO("streamed units " << swap << ": worst LoRA gradient " << worst_name << " " << worst);
      CHECK(worst <= 1e-4);
    }

    // Our diffusers-format file: peft's keys, A as peft has it, B times alpha / r.
    TempDir dir("flux-parity");
    SaveDiffusersAdapter(adapter, base.config(), dir.str() + "/a.safetensors");
    const SafetensorsFile ours = SafetensorsFile::Open(dir.str() + "/a.safetensors");
    const SafetensorsFile peft = SafetensorsFile::Open(kFixtures + name + "_peft.safetensors");
    REQUIRE(ours.tensors().size() == peft.tensors().size());
    for (const auto& e : peft.tensors()) {
      INFO(e.name);
      const bool is_b = e.name.find("lora_B") != std::string::npos;
      CHECK(at::allclose(Get(ours, e.name), Get(peft, e.name) * (is_b ? 2.0 : 1.0), 1e-6, 0));
    }
  }
}
