// `lorastream-worker parity` (the harness's side, run against transformers + peft on the CUDA
// machine) works on the CPU and writes what tools/parity/parity.py reads.
#include "torch_catch.h"  // first: see there

#include <cstdlib>

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "common/formats/safetensors.h"
#include "parity_test_util.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

TEST_CASE("lorastream-worker parity writes logits, loss, every LoRA gradient and the adapter",
          "[worker]") {
  testing::TempDir dir("parity");
  BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", "tiny"));
  const ModelConfig& c = base.config();
  testing::ParityInputs in = testing::WriteParityInputs(dir.str(), c, dir / "m");
  const at::Tensor& ids = in.ids;
  const at::Tensor& labels = in.labels;
  LoraAdapter& adapter = in.adapter;

  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker parity --model " +
                          (dir / "m") + " --tokens " + (dir / "tokens.safetensors") +
                          " --adapter " + (dir / "adapter") + " --out " + (dir / "out") +
                          " --repeat 1 --taped -1 > " + (dir / "log") + " 2>&1";
  INFO(testing::ReadFile(dir / "log"));
  REQUIRE(std::system(cmd.c_str()) == 0);
  SafetensorsFile out = SafetensorsFile::Open(dir / "out/parity.safetensors");
  auto tensor = [&](const std::string& name) {
    const SafetensorsEntry* e = out.Find(name);
    REQUIRE(e);
    return at::from_blob(const_cast<uint8_t*>(out.Data(*e)), e->shape, at::kFloat).clone();
  };
  CHECK(tensor("logits").sizes() == at::IntArrayRef({2, 16, c.vocab_size}));

  // The same computation in this process (plain autograd) agrees.
  ResidentProvider provider(base, at::kCPU, at::kFloat);
  CausalLm model(c, base.rest(), &provider, at::kCPU, at::kFloat);
  at::Tensor targets = at::cat({labels.narrow(1, 1, 15), at::full({2, 1}, -100, at::kLong)}, 1);
  at::Tensor logits = model.Logits(model.Hidden(ids, adapter, true, false, 0));
  at::Tensor loss = CausalLm::LossSum(logits, targets) / 26.0;  // 2 * (16 - 3) targets
  loss.backward();
  CHECK(at::allclose(tensor("logits"), logits.detach(), 1e-5, 1e-5));
  CHECK(tensor("loss").item<double>() == Approx(loss.item<double>()).epsilon(1e-6));
  const auto names = adapter.ParamNames();
  const auto params = adapter.Params();
  REQUIRE(names.size() == 4 * 7 * 2);
  for (size_t i = 0; i < names.size(); ++i) {
    INFO(names[i]);
    CHECK(at::allclose(tensor("grad." + names[i]), params[i].grad(), 1e-4, 1e-6));
  }
  CHECK(std::filesystem::exists(dir / "out/adapter/adapter_config.json"));
  // The timed steps ran with every block taped, and their arithmetic counts no recompute.
  const nlohmann::json speed = nlohmann::json::parse(testing::ReadFile(dir / "out/speed.json"));
  CHECK(speed["profile"]["taped_blocks"] == 4);
  // A count beyond the model's blocks is refused, naming the option.
  const std::string bad = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker parity --model " +
                          (dir / "m") + " --tokens " + (dir / "tokens.safetensors") + " --out " +
                          (dir / "out2") + " --repeat 1 --taped 5 > " + (dir / "log2") + " 2>&1";
  CHECK(std::system(bad.c_str()) != 0);
  CHECK(testing::ReadFile(dir / "log2").find("--taped") != std::string::npos);
}
