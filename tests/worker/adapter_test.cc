// The adapter's on-disk format is peft's: key names, shapes, dtypes and adapter_config.json.

#include "torch_catch.h"  // first: see there

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/model_config.h"
#include "common/formats/safetensors.h"
#include "worker/model/lora.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

ModelConfig TinyConfig() {
  ModelConfig c;
  c.model_type = "llama";
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 100;
  c.max_position_embeddings = 128;
  return c;
}

}  // namespace

TEST_CASE("adapters are written as peft writes them and read back exactly", "[worker]") {
  testing::TempDir dir("adapter");
  ModelConfig c = TinyConfig();
  LoraSettings s;
  s.rank = 8;
  s.alpha = 16;
  s.dropout = 0.05;
  s.rslora = true;
  s.targets[kQProj] = s.targets[kVProj] = s.targets[kDownProj] = true;
  LoraAdapter a = LoraAdapter::Init(c, s, 1, at::kCPU);
  {
    c10::NoGradGuard g;
    for (auto& p : a.Params()) p.add_(at::randn(p.sizes()));
  }
  a.Save(dir / "out", "/models/tiny");

  SafetensorsFile f = SafetensorsFile::Open(dir / "out/adapter_model.safetensors");
  CHECK(f.tensors().size() == 3 * 3 * 2);
  CHECK(f.header().metadata.at("format") == "pt");
  const SafetensorsEntry* qa =
      f.Find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  REQUIRE(qa);
  CHECK(qa->dtype == DType::kF32);
  CHECK(qa->shape == std::vector<int64_t>{8, 64});
  const SafetensorsEntry* vb =
      f.Find("base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight");
  REQUIRE(vb);
  CHECK(vb->shape == std::vector<int64_t>{32, 8});  // 2 kv heads * 16
  const SafetensorsEntry* da =
      f.Find("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight");
  REQUIRE(da);
  CHECK(da->shape == std::vector<int64_t>{8, 176});
  CHECK(!f.Find("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"));

  auto cfg = nlohmann::json::parse(testing::ReadFile(dir / "out/adapter_config.json"));
  CHECK(cfg["peft_type"] == "LORA");
  CHECK(cfg["task_type"] == "CAUSAL_LM");
  CHECK(cfg["r"] == 8);
  CHECK(cfg["lora_alpha"] == 16);
  CHECK(cfg["lora_dropout"] == Approx(0.05));
  CHECK(cfg["use_rslora"] == true);
  CHECK(cfg["bias"] == "none");
  CHECK(cfg["fan_in_fan_out"] == false);
  CHECK(cfg["inference_mode"] == true);
  CHECK(cfg["base_model_name_or_path"] == "/models/tiny");
  CHECK(cfg["target_modules"] == nlohmann::json({"down_proj", "q_proj", "v_proj"}));

  LoraAdapter b = LoraAdapter::Load(dir / "out", c, at::kCPU);
  CHECK(b.settings().rank == 8);
  CHECK(b.settings().rslora);
  CHECK(b.settings().Scale() == Approx(16 / std::sqrt(8.0)));
  CHECK(b.ParamNames() == a.ParamNames());
  auto pa = a.Params(), pb = b.Params();
  for (size_t i = 0; i < pa.size(); ++i) {
    CHECK(at::equal(pa[i], pb[i]));
    CHECK(pb[i].requires_grad());
  }

  // A model with other shapes is refused, naming the tensor.
  ModelConfig other = c;
  other.hidden_size = 32;
  try {
    LoraAdapter::Load(dir / "out", other, at::kCPU);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("q_proj.lora_A.weight") != std::string::npos);
  }
}

TEST_CASE("LoRA init follows peft: A kaiming-uniform(a=sqrt(5)), B zero, f32", "[worker]") {
  ModelConfig c = TinyConfig();
  LoraSettings s;
  s.rank = 16;
  s.alpha = 32;
  s.targets.fill(true);
  LoraAdapter a = LoraAdapter::Init(c, s, 5, at::kCPU);
  const LoraBlock& blk = a.block(1);
  const double bound = 1.0 / std::sqrt(64.0);
  CHECK(blk.a[kQProj].abs().max().item<double>() <= bound);
  CHECK(blk.a[kQProj].abs().max().item<double>() > 0.9 * bound);
  CHECK(blk.b[kQProj].abs().max().item<double>() == 0.0);
  CHECK(blk.a[kDownProj].abs().max().item<double>() <= 1.0 / std::sqrt(176.0));
  CHECK(blk.a[kQProj].scalar_type() == at::kFloat);
  CHECK(s.Scale() == 2.0);
  LoraAdapter again = LoraAdapter::Init(c, s, 5, at::kCPU);
  CHECK(at::equal(again.block(1).a[kQProj], blk.a[kQProj]));
}
