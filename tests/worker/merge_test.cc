// `lorastream-worker merge`: the merged model computes what the base with the adapter computes
// (f32, <= 1e-5 relative), for an LLM's Hugging Face folder (a mixture of experts' too) and
// FLUX.1's BFL file or diffusers folder, from a checkpoint or a store (a compressed one's
// dequantised weights, as it says); FLUX's two forms hold the same merged weights key for key;
// the output is complete (shards, index, config, tokenizer files) and never overwritten
// without --force; bad input is refused naming what is wrong.
#include "torch_catch.h"  // first: see there

#include <c10/core/GradMode.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/flux_layout.h"
#include "common/formats/safetensors.h"
#include "common/job/step_stats.h"
#include "moe_train_cli.h"
#include "tests/support/flux_checkpoint.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_checkpoint.h"
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

// Logits of `base` for `ids` with `adapter` (nullptr: a zero one), computed in `dtype` (the
// adapter converted to it).
at::Tensor Logits(const BaseWeights& base, const at::Tensor& ids, const LoraAdapter* adapter,
                  c10::ScalarType dtype = at::kFloat) {
  ResidentProvider provider(base, at::kCPU, dtype);
  CausalLm model(base.config(), base.rest(), &provider, at::kCPU, dtype);
  c10::NoGradGuard no_grad;
  LoraSettings none;
  none.rank = 1;
  none.targets.fill(true);
  LoraAdapter converted = LoraAdapter::Init(base.config(), adapter ? adapter->settings() : none, 0,
                                            at::kCPU);  // B = 0 without `adapter`
  const std::vector<at::Tensor> to = converted.Params();
  const std::vector<at::Tensor> from = adapter ? adapter->Params() : to;
  for (size_t i = 0; i < to.size(); ++i) to[i].set_data(from[i].to(dtype));
  return model.Logits(model.Hidden(ids, converted, false, false, 0));
}
at::Tensor Logits(const std::string& dir, const at::Tensor& ids, const LoraAdapter* adapter,
                  c10::ScalarType dtype = at::kFloat) {
  return Logits(BaseWeights::FromCheckpoint(dir), ids, adapter, dtype);
}

// Merge options of `adapters` into `base`, written to `out` in f32, without progress lines.
MergeOptions F32Merge(const std::string& base, const std::vector<std::string>& adapters,
                      const std::string& out) {
  MergeOptions o;
  o.base = base;
  o.adapters = adapters;
  o.out = out;
  o.dtype = "f32";
  o.progress = false;
  return o;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// ---- FLUX.1 ----

// Two latents of 4 x 6 with their text and timesteps, for a FLUX.1 of shape `c` (seed 5).
flux::FluxBatch TestBatch(const FluxConfig& c) {
  using namespace lorastream::worker::flux;
  at::Generator gen = at::detail::createCPUGenerator(5);
  FluxBatch b;
  b.img = PackLatents(at::empty({2, 16, 4, 6}).normal_(0, 1, gen));
  b.img_ids = ImageIds(2, 4, 6, at::kCPU);
  b.txt = at::empty({2, 8, c.context_in_dim}).normal_(0, 1, gen);
  b.txt_ids = at::zeros({2, 8, 3});
  b.y = at::empty({2, c.vec_in_dim}).normal_(0, 1, gen);
  b.timesteps = at::tensor({0.3f, 0.8f});
  b.guidance = at::full({2}, 1.0f);
  return b;
}

// The transformer's output (f32) for `b` with adapter `a`, every unit resident.
at::Tensor FluxForward(const flux::FluxBase& fb, const flux::FluxBatch& b,
                       const flux::FluxAdapter& a) {
  auto engine = fb.MakeEngine(0, 1, at::kCPU);
  flux::FluxModel model(fb.config(), fb.rest(), engine.get(), 2, at::kCPU, at::kFloat);
  c10::NoGradGuard no_grad;
  engine->BeginStep();
  at::Tensor out = model.Forward(b, a, false);
  StepStats stats;
  engine->EndStep(stats);
  return out;
}
at::Tensor FluxForward(const std::string& path, const flux::FluxBatch& b) {
  const flux::FluxBase fb = flux::FluxBase::Load(path, 2, at::kFloat, at::kCPU);
  const flux::FluxAdapter zero(fb.config(), FluxTargets({"all"}, "test"), 1, 1.0, 0,
                               at::kCPU);  // B = 0
  return FluxForward(fb, b, zero);
}

// Rank 4 on every linear sd-scripts adapts, B random: saved as DIR/adapter_kohya.safetensors.
flux::FluxAdapter SaveRandomFluxAdapter(const FluxConfig& c, const std::string& dir) {
  flux::FluxAdapter adapter(c, FluxTargets({"all"}, "test"), 4, 8.0, 11, at::kCPU);
  {
    at::Generator gen = at::detail::createCPUGenerator(12);
    c10::NoGradGuard no_grad;
    for (auto& [name, m] : adapter.modules()) m.b.normal_(0, 0.05, gen);
  }
  std::filesystem::create_directories(dir);
  flux::SaveKohyaAdapter(adapter, dir + "/" + flux::kKohyaAdapterFile);
  return adapter;
}

// BFL tensor `name` of a FLUX.1 checkpoint (either form), as f32.
at::Tensor BflTensor(const FluxCheckpointReader& r, const std::string& name) {
  std::vector<at::Tensor> rows;
  for (const FluxCheckpointReader::Piece& p : r.Pieces(name))
    rows.push_back(at::from_blob(const_cast<uint8_t*>(p.file->Data(*p.entry)), p.entry->shape,
                                 at::TensorOptions().dtype(ScalarTypeOf(p.entry->dtype, name)))
                       .narrow(0, p.source_row, p.rows)
                       .to(at::kFloat));
  return at::cat(rows, 0);
}

// A tensor of a Hugging Face folder, as f32.
at::Tensor CheckpointTensor(const Checkpoint& c, const std::string& name) {
  const Checkpoint::Ref r = c.Get(name);
  return at::from_blob(const_cast<uint8_t*>(r.file->Data(*r.entry)), r.entry->shape,
                       at::TensorOptions().dtype(ScalarTypeOf(r.entry->dtype, name)))
      .to(at::kFloat);
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
  MergeOptions o = F32Merge(model, {dir / "adapter:0.5", dir / "adapter:0.5"}, dir / "merged");
  o.max_shard_bytes = 200 << 10;
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
  const FluxBase base = FluxBase::Load(file, 2, at::kFloat, at::kCPU);
  const FluxConfig& c = base.config();
  const FluxAdapter adapter = SaveRandomFluxAdapter(c, dir / "out");

  // The kohya file read back names what it holds.
  const KohyaAdapterInfo info = ReadKohyaAdapterInfo(dir / "out/adapter_kohya.safetensors", c);
  CHECK(info.rank == 4);
  CHECK(info.alpha == 8.0);
  CHECK(info.targets == FluxTargets({"all"}, "test"));

  const FluxBatch b = TestBatch(c);
  const at::Tensor want = FluxForward(base, b, adapter);

  // The adapter named by the job's output folder (its adapter_kohya.safetensors).
  MergeOptions o = F32Merge(file, {dir / "out"}, dir / "merged.safetensors");
  RunMerge(o);
  const double err = RelativeError(FluxForward(dir / "merged.safetensors", b), want);
  INFO("relative error " << err);
  CHECK(err <= 1e-5);
  CHECK(RelativeError(FluxForward(file, b), want) > 1e-3);
  // BFL's file keeps its metadata (axes_dim, theta).
  CHECK(SafetensorsFile::Open(dir / "merged.safetensors").header().metadata ==
        SafetensorsFile::Open(file).header().metadata);
  CHECK_THROWS_WITH(RunMerge(o), Catch::Contains("--force"));

  // An fp8 file's linears take no adapter (in either form): refused, pointing to a store,
  // and nothing is written.
  testing::WriteFp8FluxCheckpoint(file, dir / "fp8.safetensors");
  o.base = dir / "fp8.safetensors";
  o.out = dir / "fp8-merged.safetensors";
  CHECK_THROWS_WITH(RunMerge(o), Catch::Contains("F8_E4M3") && Catch::Contains("store"));
  o.format = "diffusers";
  CHECK_THROWS_WITH(RunMerge(o), Catch::Contains("F8_E4M3") && Catch::Contains("store"));
  CHECK_FALSE(std::filesystem::exists(o.out));
  for (const auto& e : std::filesystem::directory_iterator(dir.str()))
    CHECK(e.path().filename().string()[0] != '.');  // no temporary left
  {  // As the refusal says: a store of it merges (into its expanded weights).
    const auto store = testing::ServeForTest(dir / "fp8.safetensors", QuantMethod::kNone, "fp8");
    o.base = store->manifest().store_name;
    o.format = "";
    RunMerge(o);
    const double fp8_err =
        RelativeError(FluxForward(o.out, b),
                      FluxForward(FluxBase::FromStore(o.base, at::kFloat, at::kCPU), b, adapter));
    INFO("fp8 store: relative error " << fp8_err);
    CHECK(fp8_err <= 1e-5);
  }
  // An unknown form, and a form for an LLM, are refused naming --format.
  o.base = file;
  o.format = "onnx";
  CHECK_THROWS_WITH(RunMerge(o), Catch::Contains("--format onnx"));
  o.base = testing::MakeCheckpoint(dir / "llm", "tiny");
  o.format = "diffusers";
  CHECK_THROWS_WITH(
      RunMerge(o), Catch::Contains("--format diffusers") && Catch::Contains("Hugging Face folder"));
}

TEST_CASE("merge: FLUX.1 from and into a diffusers folder holds the BFL merge's weights",
          "[worker][merge][flux]") {
  using namespace lorastream::worker::flux;
  testing::TempDir dir("merge-flux-diffusers");
  const std::string file = testing::MakeFluxCheckpoint(dir / "bfl");
  // The same weights as diffusers stores them, in 3+ shards.
  const std::string diffusers =
      testing::MakeFluxCheckpoint(dir / "diffusers", "f32", "diffusers", 400000);
  const FluxBase base = FluxBase::Load(file, 2, at::kFloat, at::kCPU);
  const FluxConfig& c = base.config();
  const FluxAdapter adapter = SaveRandomFluxAdapter(c, dir / "out");
  const FluxBatch b = TestBatch(c);
  const at::Tensor want = FluxForward(base, b, adapter);

  MergeOptions o = F32Merge("", {dir / "out:0.5", dir / "out:0.5"}, "");
  auto merge = [&](const std::string& from, const std::string& to, const std::string& format) {
    o.base = from;
    o.out = to;
    o.format = format;
    RunMerge(o);
    return to;
  };
  const FluxCheckpointReader want_tensors =
      FluxCheckpointReader::Open(merge(file, dir / "bfl.safetensors", ""));
  o.max_shard_bytes = 300000;
  const std::string outputs[] = {merge(diffusers, dir / "from-diffusers", ""),  // its own form
                                 merge(file, dir / "bfl-to-diffusers", "diffusers"),
                                 merge(diffusers, dir / "diffusers-to-bfl.safetensors", "bfl")};
  for (const std::string& out : outputs) {
    INFO(out);
    const FluxCheckpointReader got = FluxCheckpointReader::Open(out);
    CHECK(got.is_diffusers() == (out.find(".safetensors") == std::string::npos));
    // Key for key through FluxDiffusersParts: every BFL tensor is the BFL merge's.
    int differ = 0;
    std::string first;
    for (const auto& [name, shape] : FluxAllShapes(c))
      if (RelativeError(BflTensor(got, name), BflTensor(want_tensors, name)) > 1e-6) {
        if (differ++ == 0) first = name;
      }
    INFO("first differing tensor: " << first);
    CHECK(differ == 0);
    // And it computes base + adapter.
    const double err = RelativeError(FluxForward(out, b), want);
    INFO("relative error " << err);
    CHECK(err <= 1e-5);
  }
  // A diffusers folder: transformer/ with the base's config.json (a BFL base's made for it),
  // its weights in shards and their index (one file when they fit).
  CHECK(ReadText(dir / "from-diffusers/transformer/config.json") ==
        ReadText(diffusers + "/transformer/config.json"));
  CHECK(nlohmann::json::parse(
            ReadText(dir / "bfl-to-diffusers/transformer/config.json"))["_class_name"] ==
        "FluxTransformer2DModel");
  CHECK(std::filesystem::exists(
      dir / "bfl-to-diffusers/transformer/diffusion_pytorch_model.safetensors.index.json"));
  o.max_shard_bytes = 5ull << 30;
  merge(diffusers, dir / "one-file", "");
  CHECK(std::filesystem::exists(dir / "one-file/transformer/diffusion_pytorch_model.safetensors"));
  CHECK_FALSE(std::filesystem::exists(
      dir / "one-file/transformer/diffusion_pytorch_model.safetensors.index.json"));
  // Never overwritten without --force; replaced with it.
  CHECK_THROWS_WITH(merge(diffusers, dir / "one-file", ""), Catch::Contains("--force"));
  o.force = true;
  o.dtype = "bf16";
  merge(file, dir / "one-file", "diffusers");
  CHECK(RelativeError(FluxForward(dir / "one-file", b), want) < 3e-2);
  // A file replaced by a folder, and back.
  merge(file, dir / "swap.safetensors", "bfl");
  merge(file, dir / "swap.safetensors", "diffusers");
  CHECK(std::filesystem::is_directory(dir / "swap.safetensors/transformer"));
  merge(file, dir / "swap.safetensors", "bfl");
  CHECK(std::filesystem::is_regular_file(dir / "swap.safetensors"));
  for (const auto& e : std::filesystem::directory_iterator(dir.str()))
    CHECK(e.path().filename().string()[0] != '.');  // no temporary left

  // A diffusers folder missing a tensor is refused naming it.
  const std::string index =
      diffusers + "/transformer/diffusion_pytorch_model.safetensors.index.json";
  nlohmann::json j = nlohmann::json::parse(ReadText(index));
  j["weight_map"].erase("proj_out.weight");
  std::ofstream(index, std::ios::trunc) << j.dump(2);
  CHECK_THROWS_WITH(merge(diffusers, dir / "bad", ""), Catch::Contains("proj_out.weight"));

  // The command line: --format diffusers.
  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker merge --base " +
                          file + " --adapter " + (dir / "out") + " --format diffusers --out " +
                          (dir / "cli") + " --dtype f32 > " + (dir / "log") + " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  CHECK(ReadText(dir / "log").find("diffusers folder") != std::string::npos);
  CHECK(std::filesystem::exists(dir / "cli/transformer/config.json"));
}

TEST_CASE("merge: a compressed FLUX.1 store merges into its dequantised weights and says so",
          "[worker][merge][flux]") {
  using namespace lorastream::worker::flux;
  testing::TempDir dir("merge-flux-store");
  const std::string file = testing::MakeFluxCheckpoint(dir / "model");
  const FluxConfig c = FluxCheckpointReader::Open(file).config();
  const FluxAdapter adapter = SaveRandomFluxAdapter(c, dir / "out");
  const FluxBatch b = TestBatch(c);
  for (const QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    const std::string tag = QuantMethodName(method);
    DYNAMIC_SECTION(tag) {
      const auto store = testing::ServeForTest(file, method, "merge-flux");
      const std::string name = store->manifest().store_name;
      // The store as the worker computes with it.
      const at::Tensor want =
          FluxForward(FluxBase::FromStore(name, at::kFloat, at::kCPU), b, adapter);
      // A store's default form: BFL's file.
      MergeOptions o = F32Merge(name, {dir / "out"}, dir / ("merged-" + tag + ".safetensors"));
      RunMerge(o);
      double err = RelativeError(FluxForward(o.out, b), want);
      INFO("relative error " << err);
      CHECK(err <= 1e-5);
      CHECK(RelativeError(FluxForward(file, b), want) > 1e-3);  // not the original's weights
      o.format = "diffusers";
      o.out = dir / ("merged-" + tag);
      RunMerge(o);
      err = RelativeError(FluxForward(o.out, b), want);
      INFO("diffusers: relative error " << err);
      CHECK(err <= 1e-5);
      // The summary line says what it merged into.
      const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker merge --base " +
                              name + " --adapter " + (dir / "out") + " --out " +
                              (dir / ("cli-" + tag + ".safetensors")) + " > " + (dir / "stdout") +
                              " 2> " + (dir / "stderr");
      REQUIRE(std::system(cmd.c_str()) == 0);
      INFO(ReadText(dir / "stdout"));
      CHECK(ReadText(dir / "stdout").find("compressed") != std::string::npos);
      CHECK(ReadText(dir / "stdout").find("dequantised") != std::string::npos);
      CHECK(ReadText(dir / "stderr").find("is compressed") != std::string::npos);
    }
  }
}

TEST_CASE("merge: a trained mixture-of-experts adapter merges into base + adapter",
          "[worker][merge][moe]") {
  for (const char* preset : {"tiny-moe", "tiny-mixtral"}) {
    DYNAMIC_SECTION(preset) {
      testing::TempDir dir("merge-moe");
      const std::string model = testing::MakeCheckpoint(dir / "m", preset);
      testing::WriteJsonl(dir / "d.jsonl", 4, 12, 30, 512);
      testing::TrainMoeCli(dir, dir / "out", 4, 0, 1e-2);  // attention and every expert
      const ModelConfig c = BaseWeights::FromCheckpoint(model).config();
      const LoraAdapter adapter = LoraAdapter::Load(dir / "out", c, at::kCPU);
      at::Generator gen = at::detail::createCPUGenerator(9);
      const at::Tensor ids = at::randint(0, c.vocab_size, {2, 16}, gen, at::kLong);
      // Computed in f64 over the f32 merged weights: an f32 forward's own rounding is about
      // 1e-5 of these logits (the trained updates are large), either way round.
      const at::Tensor want = Logits(model, ids, &adapter, at::kDouble);

      MergeOptions o = F32Merge(model, {dir / "out"}, dir / "merged");
      RunMerge(o);
      double err = RelativeError(Logits(dir / "merged", ids, nullptr, at::kDouble), want);
      INFO("relative error " << err);
      CHECK(err <= 1e-5);
      CHECK(RelativeError(Logits(model, ids, nullptr, at::kDouble), want) > 1e-3);
      // In f32 the two agree to that rounding.
      CHECK(RelativeError(Logits(dir / "merged", ids, nullptr), Logits(model, ids, &adapter)) <=
            1e-4);
      // Every expert's three projections took their update.
      const Checkpoint merged = Checkpoint::Open(dir / "merged"),
                       original = Checkpoint::Open(model);
      for (int64_t e = 0; e < c.num_experts; ++e)
        for (int p = 0; p < 3; ++p) {
          const std::string name = "model.layers.1." + c.ExpertModule(e, p) + ".weight";
          INFO(name);
          CHECK_FALSE(
              at::allclose(CheckpointTensor(merged, name), CheckpointTensor(original, name)));
        }

      // From a store of it, the same.
      const auto store = testing::ServeForTest(model, QuantMethod::kNone, "merge-moe");
      o.base = store->manifest().store_name;
      o.out = dir / "merged-store";
      RunMerge(o);
      err = RelativeError(Logits(dir / "merged-store", ids, nullptr, at::kDouble),
                          Logits(BaseWeights::FromStore(o.base), ids, &adapter, at::kDouble));
      INFO("from a store: relative error " << err);
      CHECK(err <= 1e-5);
    }
  }
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

  MergeOptions o = F32Merge(name, {dir / "adapter"}, dir / "merged");
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
