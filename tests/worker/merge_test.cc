// `lorastream-worker merge`: the merged model computes what the base with the adapter computes
// (f32, <= 1e-5 relative), for an LLM's Hugging Face folder and FLUX.1's BFL file; the output
// is complete (shards, index, config, tokenizer files) and never overwritten without --force.
#include "torch_catch.h"  // first: see there

#include <c10/core/GradMode.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/safetensors.h"
#include "common/step_stats.h"
#include "tests/support/flux_checkpoint.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_model.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/serve/merge.h"
#include "worker/stream/resident_provider.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

// Logits of `base` (f32) for `ids` with `adapter` (nullptr: a zero one).
at::Tensor Logits(const BaseWeights& base, const at::Tensor& ids, const LoraAdapter* adapter) {
  ResidentProvider provider(base, at::kCPU, at::kFloat);
  CausalLm model(base.config(), base.rest(), &provider, at::kCPU, at::kFloat);
  c10::NoGradGuard no_grad;
  LoraSettings none;
  none.rank = 1;
  none.targets.fill(true);
  const LoraAdapter zero = LoraAdapter::Init(base.config(), none, 0, at::kCPU);  // B = 0
  return model.Logits(model.Hidden(ids, adapter ? *adapter : zero, false, false, 0));
}
at::Tensor Logits(const std::string& dir, const at::Tensor& ids, const LoraAdapter* adapter) {
  return Logits(BaseWeights::FromCheckpoint(dir), ids, adapter);
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("merge: an LLM merged into a Hugging Face folder computes base + adapter",
          "[worker][merge]") {
  testing::TempDir dir("merge-llm");
  const std::string model = testing::MakeCheckpoint(dir / "m", "tiny");
  std::ofstream(dir / "m/tokenizer_config.json") << "{\"model_max_length\": 256}\n";
  const ModelConfig c = BaseWeights::FromCheckpoint(model).config();
  LoraSettings s;
  s.rank = 4;
  s.alpha = 8;
  s.targets.fill(true);
  LoraAdapter adapter = LoraAdapter::Init(c, s, 3, at::kCPU);
  {
    c10::NoGradGuard g;
    for (auto& p : adapter.Params()) p.uniform_(-0.1, 0.1);
  }
  adapter.Save(dir / "adapter", model);
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 16}, at::kLong);
  const at::Tensor want = Logits(model, ids, &adapter);

  // Twice at half weight (two adapters, weights) in f32, shards of ~200 kB.
  MergeOptions o;
  o.base = model;
  o.adapters = {dir / "adapter:0.5", dir / "adapter:0.5"};
  o.out = dir / "merged";
  o.dtype = "f32";
  o.max_shard_bytes = 200 << 10;
  o.progress = false;
  RunMerge(o);
  const at::Tensor got = Logits(dir / "merged", ids, nullptr);
  const double err = RelativeError(got, want);
  INFO("relative error " << err);
  CHECK(err <= 1e-5);
  // The base alone is far from it: the adapter is in the merged weights.
  CHECK(RelativeError(Logits(model, ids, nullptr), want) > 1e-3);

  // A Hugging Face folder: shards and their index, config (dtype), the tokenizer's files.
  const nlohmann::json index =
      nlohmann::json::parse(ReadText(dir / "merged/model.safetensors.index.json"));
  int shards = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir / "merged"))
    shards += e.path().filename().string().rfind("model-", 0) == 0;
  CHECK(shards > 1);
  CHECK(index["weight_map"]["model.layers.0.self_attn.q_proj.weight"].get<std::string>().find(
            "-of-") != std::string::npos);
  CHECK(std::filesystem::exists(dir / "merged/tokenizer_config.json"));
  CHECK(nlohmann::json::parse(ReadText(dir / "merged/config.json"))["torch_dtype"] == "float32");
  for (const auto& e : std::filesystem::directory_iterator(dir / "merged"))
    CHECK(e.path().filename().string()[0] != '.');  // no temporary left

  // Never overwritten without --force; bf16 by default.
  o.dtype = "bf16";
  CHECK_THROWS_WITH(RunMerge(o), Catch::Contains("--force"));
  o.force = true;
  RunMerge(o);
  const Checkpoint merged = Checkpoint::Open(dir / "merged");
  CHECK(merged.Get("model.layers.1.mlp.down_proj.weight").entry->dtype == DType::kBF16);
  CHECK(nlohmann::json::parse(ReadText(dir / "merged/config.json"))["torch_dtype"] == "bfloat16");
  CHECK(RelativeError(Logits(dir / "merged", ids, nullptr), want) < 3e-2);

  // The command line: PATH:WEIGHT, a refusal naming --force.
  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker merge --base " +
                          model + " --adapter " + (dir / "adapter") + ":1 --out " +
                          (dir / "merged") + " --dtype f32 > " + (dir / "log") + " 2>&1";
  CHECK(std::system(cmd.c_str()) != 0);
  CHECK(ReadText(dir / "log").find("--force") != std::string::npos);
  REQUIRE(std::system((cmd + " --force").c_str()) == 0);
  CHECK(RelativeError(Logits(dir / "merged", ids, nullptr), want) <= 1e-5);
}

TEST_CASE("merge: adapter arguments take an optional weight after the last ':'",
          "[worker][merge]") {
  CHECK(ParseAdapterArg("out").path == "out");
  CHECK(ParseAdapterArg("out:0.25").weight == 0.25);
  CHECK(ParseAdapterArg("out:0.25").path == "out");
  CHECK(ParseAdapterArg("/a:b/out").path == "/a:b/out");
  CHECK(ParseAdapterArg("/a:b/out").weight == 1.0);
  CHECK(ParseAdapterArg("x:-1").weight == -1.0);
}

TEST_CASE("merge: FLUX.1 merged into BFL's file computes base + adapter", "[worker][merge][flux]") {
  using namespace lorastream::worker::flux;
  testing::TempDir dir("merge-flux");
  const std::string file = testing::MakeFluxCheckpoint(dir / "model");
  FluxBase base = FluxBase::Load(file, 2, at::kFloat, at::kCPU);
  const FluxConfig& c = base.config();
  FluxAdapter adapter(c, FluxTargets({"all"}, "test"), 4, 8.0, 11, at::kCPU);
  {
    at::Generator gen = at::detail::createCPUGenerator(12);
    c10::NoGradGuard no_grad;
    for (auto& [name, m] : adapter.modules()) m.b.normal_(0, 0.05, gen);
  }
  std::filesystem::create_directories(dir / "out");
  SaveKohyaAdapter(adapter, dir / "out/adapter_kohya.safetensors");

  // The kohya file read back names what it holds.
  const KohyaAdapterInfo info = ReadKohyaAdapterInfo(dir / "out/adapter_kohya.safetensors", c);
  CHECK(info.rank == 4);
  CHECK(info.alpha == 8.0);
  CHECK(info.targets == FluxTargets({"all"}, "test"));

  at::Generator gen = at::detail::createCPUGenerator(5);
  FluxBatch b;
  b.img = PackLatents(at::empty({2, 16, 4, 6}).normal_(0, 1, gen));
  b.img_ids = ImageIds(2, 4, 6, at::kCPU);
  b.txt = at::empty({2, 8, c.context_in_dim}).normal_(0, 1, gen);
  b.txt_ids = at::zeros({2, 8, 3});
  b.y = at::empty({2, c.vec_in_dim}).normal_(0, 1, gen);
  b.timesteps = at::tensor({0.3f, 0.8f});
  b.guidance = at::full({2}, 1.0f);
  auto forward = [&](FluxBase& fb, const FluxAdapter& a) {
    auto engine = fb.MakeEngine(0, 1, at::kCPU);
    FluxModel model(fb.config(), fb.rest(), engine.get(), 2, at::kCPU, at::kFloat);
    c10::NoGradGuard no_grad;
    engine->BeginStep();
    at::Tensor out = model.Forward(b, a, false);
    StepStats stats;
    engine->EndStep(stats);
    return out;
  };
  const at::Tensor want = forward(base, adapter);
  const FluxAdapter zero(c, FluxTargets({"all"}, "test"), 1, 1.0, 0, at::kCPU);  // B = 0

  MergeOptions o;
  o.base = file;
  o.adapters = {dir / "out"};  // the job's output folder: its adapter_kohya.safetensors
  o.out = dir / "merged.safetensors";
  o.dtype = "f32";
  o.progress = false;
  RunMerge(o);
  FluxBase merged = FluxBase::Load(dir / "merged.safetensors", 2, at::kFloat, at::kCPU);
  const double err = RelativeError(forward(merged, zero), want);
  INFO("relative error " << err);
  CHECK(err <= 1e-5);
  CHECK(RelativeError(forward(base, zero), want) > 1e-3);
  // BFL's file keeps its metadata (axes_dim, theta).
  CHECK(SafetensorsFile::Open(dir / "merged.safetensors").header().metadata ==
        SafetensorsFile::Open(file).header().metadata);
  CHECK_THROWS_WITH(RunMerge(o), Catch::Contains("--force"));
}

TEST_CASE("merge: a compressed store merges into its dequantised weights and says so",
          "[worker][merge]") {
  testing::TempDir dir("merge-store");
  const std::string model = testing::MakeCheckpoint(dir / "m", "tiny-qwen3");
  std::ofstream(dir / "m/tokenizer_config.json") << "{}\n";
  const auto store = testing::ServeForTest(model, QuantMethod::kNf4, "merge", true, true);
  const std::string name = store->manifest().store_name;
  const BaseWeights base = BaseWeights::FromStore(name);
  LoraSettings s;
  s.rank = 4;
  s.alpha = 4;
  s.targets[kQProj] = s.targets[kDownProj] = true;
  LoraAdapter adapter = LoraAdapter::Init(base.config(), s, 5, at::kCPU);
  {
    c10::NoGradGuard g;
    for (auto& p : adapter.Params()) p.uniform_(-0.1, 0.1);
  }
  adapter.Save(dir / "adapter", model);
  const at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 12}, at::kLong);
  const at::Tensor want = Logits(base, ids, &adapter);  // the store as the worker computes it

  MergeOptions o;
  o.base = name;
  o.adapters = {dir / "adapter"};
  o.out = dir / "merged";
  o.dtype = "f32";
  o.progress = false;
  RunMerge(o);
  const double err = RelativeError(Logits(dir / "merged", ids, nullptr), want);
  INFO("relative error " << err);
  CHECK(err <= 1e-5);
  CHECK(std::filesystem::exists(dir / "merged/tokenizer_config.json"));  // from its source
  // The command says what it merged into.
  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker merge --base " +
                          name + " --adapter " + (dir / "adapter") + " --out " +
                          (dir / "merged-cli") + " > " + (dir / "log") + " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  CHECK(ReadText(dir / "log").find("is compressed") != std::string::npos);
  CHECK(ReadText(dir / "log").find("dequantised") != std::string::npos);
}
