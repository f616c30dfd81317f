// Mixtures of experts (qwen3_moe, mixtral; worker/model/moe_mlp.h) on the LLM block: the
// checkpointed block's gradients equal plain autograd's, a taped block equals its recompute,
// a job in a group equals itself alone and a streamed run equals the resident one bit for bit,
// a tiny MoE trains through `lorastream-worker train` and resumes to the uninterrupted run's
// adapter, bad checkpoints are refused by name, and the logits, loss and every LoRA gradient
// match transformers 5.17 + peft 0.21 (tests/fixtures/moe, tools/parity/moe_fixtures.py).
#include "torch_catch.h"  // first: see there

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/data.h"
#include "common/formats/model_config.h"
#include "common/formats/safetensors.h"
#include "common/job/job_spec.h"
#include "moe_train_cli.h"
#include "worker/model/base_weights.h"
#include "worker/model/block.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

const char* kPresets[] = {"tiny-moe", "tiny-mixtral"};

LoraSettings MoeSettings() {
  LoraSettings s;
  s.rank = 4;
  s.alpha = 8;
  s.targets.fill(true);  // attention and every expert's gate, up, down
  return s;
}

// An adapter whose A and B are all random (every gradient path carries signal).
LoraAdapter RandomAdapter(const ModelConfig& c, uint64_t seed) {
  LoraAdapter a = LoraAdapter::Init(c, MoeSettings(), seed, at::kCPU);
  c10::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
  for (auto& p : a.Params()) p.uniform_(-0.1, 0.1, gen);
  return a;
}

struct Run {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
};

Run RunOnce(const BaseWeights& base, LoraAdapter& adapter, bool checkpointed, const at::Tensor& ids,
            int taped_blocks = 0) {
  ResidentProvider provider(base, at::kCPU, at::kFloat);
  provider.set_taped_blocks(taped_blocks);
  CausalLm model(base.config(), base.rest(), &provider, at::kCPU, at::kFloat);
  for (auto& p : adapter.Params()) p.mutable_grad() = at::Tensor();
  at::Tensor targets =
      at::cat({ids.narrow(1, 1, ids.size(1) - 1), at::full({ids.size(0), 1}, -100, at::kLong)}, 1);
  provider.BeginStep();
  at::Tensor loss =
      CausalLm::LossSum(model.Logits(model.Hidden(ids, adapter, true, checkpointed, 7)), targets) /
      10.0;
  loss.backward();
  Run r;
  r.loss = loss.detach();
  for (auto& p : adapter.Params())
    r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return r;
}

double RelativeDistance(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

at::Tensor Read(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsEntry* e = f.Find(name);
  INFO(name);
  REQUIRE(e != nullptr);
  return at::from_blob(const_cast<uint8_t*>(f.Data(*e)), e->shape,
                       e->dtype == DType::kI64 ? at::kLong : at::kFloat)
      .clone();
}

}  // namespace

TEST_CASE("moe: model_config reads qwen3_moe and mixtral and refuses what it cannot train",
          "[moe]") {
  const nlohmann::json qwen = {
      {"model_type", "qwen3_moe"}, {"hidden_size", 32},
      {"intermediate_size", 64},   {"moe_intermediate_size", 16},
      {"num_hidden_layers", 2},    {"num_attention_heads", 4},
      {"num_key_value_heads", 2},  {"head_dim", 8},
      {"vocab_size", 64},          {"num_experts", 4},
      {"num_experts_per_tok", 2},  {"norm_topk_prob", true},
      {"decoder_sparse_step", 1},  {"mlp_only_layers", nlohmann::json::array()}};
  const ModelConfig c = ModelConfigFromJson(qwen, "q.json");
  CHECK(c.is_moe());
  CHECK(c.num_experts == 4);
  CHECK(c.moe_intermediate_size == 16);
  CHECK(c.norm_topk_prob);
  CHECK(c.qk_norm);
  const auto shapes = c.BlockTensorShapes();
  CHECK(std::find_if(shapes.begin(), shapes.end(), [](const auto& s) {
          return s.first == "mlp.experts.3.down_proj.weight" &&
                 s.second == std::vector<int64_t>{32, 16};
        }) != shapes.end());
  // Written back and read again: the same config (the store's manifest carries it so).
  nlohmann::json round;
  ToJson(round, c);
  const ModelConfig again = ModelConfigFromJson(round, "round");
  CHECK(again.num_experts == 4);
  CHECK(again.moe_intermediate_size == 16);
  CHECK(again.norm_topk_prob);
  CHECK(again.BlockTensorShapes() == shapes);

  auto refused = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = qwen;
    j[key] = value;
    try {
      ModelConfigFromJson(j, "q.json");
    } catch (const Error& e) {
      return std::string(e.what()).find(key) != std::string::npos &&
             std::string(e.what()).find("q.json") != std::string::npos;
    }
    return false;
  };
  CHECK(refused("decoder_sparse_step", 2));
  CHECK(refused("mlp_only_layers", nlohmann::json::array({0})));
  CHECK(refused("shared_expert_intermediate_size", 64));
  CHECK(refused("num_experts_per_tok", 5));
  // transformers 5.17 saves Qwen3-MoE's num_experts as num_local_experts.
  nlohmann::json saved = qwen;
  saved.erase("num_experts");
  saved["num_local_experts"] = 4;
  CHECK(ModelConfigFromJson(saved, "q.json").num_experts == 4);
  saved.erase("num_local_experts");
  CHECK_THROWS_WITH(ModelConfigFromJson(saved, "q.json"), Catch::Contains("`num_experts`"));
  nlohmann::json missing = qwen;
  missing.erase("moe_intermediate_size");
  CHECK_THROWS_WITH(ModelConfigFromJson(missing, "q.json"),
                    Catch::Contains("moe_intermediate_size"));

  nlohmann::json mixtral = qwen;
  mixtral.erase("num_experts");
  mixtral["model_type"] = "mixtral";
  mixtral["num_local_experts"] = 4;
  const ModelConfig m = ModelConfigFromJson(mixtral, "m.json");
  CHECK(m.moe_intermediate_size == 64);  // mixtral's experts are intermediate_size wide
  CHECK(m.norm_topk_prob);
  CHECK(!m.qk_norm);
  CHECK(m.ExpertModule(2, 2) == "block_sparse_moe.experts.2.w2");
  mixtral["router_jitter_noise"] = 0.01;
  CHECK_THROWS_WITH(ModelConfigFromJson(mixtral, "m.json"), Catch::Contains("router_jitter_noise"));
}

TEST_CASE("moe: checkpointed blocks give plain autograd's loss and gradients to f32 rounding",
          "[moe]") {
  for (const char* preset : kPresets) {
    DYNAMIC_SECTION(preset) {
      testing::TempDir dir("moe-ckpt");
      BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
      LoraAdapter adapter = RandomAdapter(base.config(), 3);
      at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 24}, at::kLong);
      const Run plain = RunOnce(base, adapter, false, ids);
      const Run ckpt = RunOnce(base, adapter, true, ids);
      CHECK(RelativeDistance(ckpt.loss, plain.loss) < 1e-6);
      REQUIRE(plain.grads.size() == ckpt.grads.size());
      int nonzero = 0;
      const auto names = adapter.ParamNames();
      for (size_t i = 0; i < plain.grads.size(); ++i) {
        INFO(names[i]);
        CHECK(RelativeDistance(ckpt.grads[i], plain.grads[i]) < 1e-5);
        nonzero += plain.grads[i].abs().sum().item<double>() > 0;
      }
      // 48 tokens x 2 experts each: nearly every expert of every block is reached.
      CHECK(nonzero > static_cast<int>(plain.grads.size()) * 3 / 4);
      // Taped blocks skip the recompute and give the same bits.
      const Run taped = RunOnce(base, adapter, true, ids, base.num_blocks());
      CHECK(at::equal(taped.loss, ckpt.loss));
      for (size_t i = 0; i < taped.grads.size(); ++i)
        CHECK(at::equal(taped.grads[i], ckpt.grads[i]));
    }
  }
}

TEST_CASE("moe: a job in a group computes what it computes alone, bit for bit", "[moe]") {
  for (const char* preset : kPresets) {
    DYNAMIC_SECTION(preset) {
      testing::TempDir dir("moe-group");
      BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
      const ModelConfig& c = base.config();
      const BlockWeights& w = base.block(1);
      const RotaryTables rope16 = BuildRotary(c, 16, at::kCPU, at::kFloat);
      const RotaryTables rope8 = BuildRotary(c, 8, at::kCPU, at::kFloat);
      const LoraAdapter a1 = RandomAdapter(c, 5), a2 = RandomAdapter(c, 9);
      const LoraBlockCast l1 = CastLoraBlock(a1.block(1), at::kFloat);
      const LoraBlockCast l2 = CastLoraBlock(a2.block(1), at::kFloat);
      BlockCompute c1{&c, &rope16, 2.0, 0.0, true, 1};
      BlockCompute c2{&c, &rope8, 3.0, 0.0, true, 2};
      at::Tensor x1 = at::randn({2, 16, c.hidden_size}), x2 = at::randn({1, 8, c.hidden_size});
      at::Tensor dy1 = at::randn_like(x1), dy2 = at::randn_like(x2);

      std::vector<LoraBlockGrads> group_grads;
      BlockTape tape;
      const std::vector<BlockJob> jobs = {{&l1, &c1}, {&l2, &c2}};
      const auto ys = GroupBlockForwardTaped({x1, x2}, w, jobs, &tape);
      const auto dxs = GroupBlockBackward(tape, w, jobs, {dy1, dy2}, true, group_grads);
      const std::vector<std::pair<const LoraBlockCast*, const BlockCompute*>> alone = {{&l1, &c1},
                                                                                       {&l2, &c2}};
      const std::vector<at::Tensor> xs = {x1, x2}, dys = {dy1, dy2};
      for (size_t j = 0; j < 2; ++j) {
        BlockTape t;
        LoraBlockGrads g;
        const at::Tensor y = BlockForwardTaped(xs[j], w, *alone[j].first, *alone[j].second, &t);
        const at::Tensor dx =
            BlockBackward(t, w, *alone[j].first, *alone[j].second, dys[j], true, g);
        CHECK(at::equal(y, ys[j]));
        CHECK(at::equal(dx, dxs[j]));
        LoraSettings s = MoeSettings();
        const auto got = LoraSlots(c, s, group_grads[j]);
        const auto want = LoraSlots(c, s, g);
        REQUIRE(got.size() == want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          INFO(got[i].module);
          CHECK(at::equal(*got[i].a, *want[i].a));
          CHECK(at::equal(*got[i].b, *want[i].b));
        }
      }
    }
  }
}

TEST_CASE("moe: lorastream-worker train trains a tiny MoE, streamed as resident, and resumes",
          "[moe]") {
  for (const char* preset : kPresets) {
    DYNAMIC_SECTION(preset) {
      testing::TempDir dir("moe-cli");
      testing::MakeCheckpoint(dir / "m", preset);
      testing::WriteJsonl(dir / "d.jsonl", 4, 12, 30, 512);
      const std::string whole = testing::TrainMoeCli(dir, dir / "whole", 4, 0);
      CHECK(testing::ReadFile(dir / "log").find("step 4/4 loss ") != std::string::npos);
      // Streamed (3 of 4 blocks through the engine): the same adapter, bit for bit.
      CHECK(testing::TrainMoeCli(dir, dir / "streamed", 4, 3) == whole);
      // 2 steps, then the job extended to 4: resumes from checkpoint-2 to the same adapter.
      testing::TrainMoeCli(dir, dir / "resumed", 2, 0);
      CHECK(testing::TrainMoeCli(dir, dir / "resumed", 4, 0) == whole);
      // The adapter is peft's per-expert layout, target_modules in the model's names.
      SafetensorsFile f = SafetensorsFile::Open(dir / "whole/adapter_model.safetensors");
      const ModelConfig c = LoadModelConfig(dir / "m/config.json");
      CHECK(f.Find("base_model.model.model.layers.3." + c.ExpertModule(c.num_experts - 1, 2) +
                   ".lora_B.weight") != nullptr);
      const auto cfg = nlohmann::json::parse(testing::ReadFile(dir / "whole/adapter_config.json"));
      const auto targets = cfg["target_modules"].get<std::vector<std::string>>();
      CHECK(std::find(targets.begin(), targets.end(), c.ExpertProjName(0)) != targets.end());
    }
  }
}

TEST_CASE("moe: a checkpoint missing an expert, or with one too many, is refused by name",
          "[moe]") {
  testing::TempDir dir("moe-bad");
  testing::MakeCheckpoint(dir / "m", "tiny-mixtral");
  const std::string config = testing::ReadFile(dir / "m/config.json");
  auto with_experts = [&](int n) {
    nlohmann::json j = nlohmann::json::parse(config);
    j["num_local_experts"] = n;
    std::ofstream(dir / "m/config.json", std::ios::trunc) << j.dump(2);
  };
  with_experts(5);  // the checkpoint holds 4
  CHECK_THROWS_WITH(BaseWeights::FromCheckpoint(dir / "m"),
                    Catch::Contains("block_sparse_moe.gate.weight"));
  with_experts(3);
  CHECK_THROWS_WITH(BaseWeights::FromCheckpoint(dir / "m"), Catch::Contains("block_sparse_moe"));
  std::ofstream(dir / "m/config.json", std::ios::trunc) << config;
  CHECK_NOTHROW(BaseWeights::FromCheckpoint(dir / "m"));
}

TEST_CASE("moe: parity with transformers 5.17 + peft 0.21 on committed fixtures", "[moe]") {
  const std::string fx = std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/moe";
  for (const char* name : {"mixtral", "qwen3_moe"}) {
    INFO(name);
    REQUIRE(std::filesystem::exists(fx + "/" + name + "_case.safetensors"));
    DYNAMIC_SECTION(name) {
      testing::TempDir dir("moe-parity");
      namespace fs = std::filesystem;
      fs::create_directories(dir / "m");
      fs::create_directories(dir / "a");
      fs::copy_file(fx + "/" + name + "_config.json", dir / "m/config.json");
      fs::copy_file(fx + "/" + name + "_model.safetensors", dir / "m/model.safetensors");
      fs::copy_file(fx + "/" + name + "_adapter_config.json", dir / "a/adapter_config.json");
      fs::copy_file(fx + "/" + name + "_adapter_model.safetensors",
                    dir / "a/adapter_model.safetensors");
      BaseWeights base = BaseWeights::FromCheckpoint(dir / "m");
      const ModelConfig& c = base.config();
      LoraAdapter adapter = LoraAdapter::Load(dir / "a", c, at::kCPU);
      SafetensorsFile cs = SafetensorsFile::Open(fx + "/" + name + "_case.safetensors");
      const at::Tensor ids = Read(cs, "input_ids"), labels = Read(cs, "labels");

      ResidentProvider provider(base, at::kCPU, at::kFloat);
      CausalLm model(c, base.rest(), &provider, at::kCPU, at::kFloat);
      const int64_t s = ids.size(1);
      at::Tensor targets =
          at::cat({labels.narrow(1, 1, s - 1), at::full({ids.size(0), 1}, -100, at::kLong)}, 1);
      const double count = targets.ne(-100).sum().item<double>();
      provider.BeginStep();
      at::Tensor logits = model.Logits(model.Hidden(ids, adapter, true, true, 0));
      at::Tensor loss = CausalLm::LossSum(logits, targets) / count;
      loss.backward();
      CHECK(RelativeDistance(logits.detach(), Read(cs, "logits")) < 1e-4);
      CHECK(loss.item<double>() == Approx(Read(cs, "loss").item<double>()).epsilon(1e-4));
      const auto names = adapter.ParamNames();
      const auto params = adapter.Params();
      REQUIRE(names.size() == 2 * (4 + 3 * c.num_experts) * c.num_hidden_layers);
      for (size_t i = 0; i < names.size(); ++i) {
        INFO(names[i]);
        REQUIRE(params[i].grad().defined());
        CHECK(RelativeDistance(params[i].grad(), Read(cs, "grad." + names[i])) < 1e-4);
      }
      // Saved again: peft's keys and target_modules, the same values.
      adapter.Save(dir / "saved", "m");
      SafetensorsFile ours = SafetensorsFile::Open(dir / "saved/adapter_model.safetensors");
      SafetensorsFile peft = SafetensorsFile::Open(dir / "a/adapter_model.safetensors");
      CHECK(ours.tensors().size() == peft.tensors().size());
      for (const auto& e : peft.tensors()) CHECK(at::equal(Read(ours, e.name), Read(peft, e.name)));
      auto sorted_targets = [](const std::string& path) {
        auto t = nlohmann::json::parse(testing::ReadFile(path))["target_modules"]
                     .get<std::vector<std::string>>();
        std::sort(t.begin(), t.end());
        return t;
      };
      CHECK(sorted_targets(dir / "saved/adapter_config.json") ==
            sorted_targets(dir / "a/adapter_config.json"));
    }
  }
}
