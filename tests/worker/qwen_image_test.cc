// Qwen-Image on the CPU: parity with diffusers' QwenImageTransformer2DModel and peft on the
// fixtures in tests/fixtures/qwen_image/ (made on the CUDA machine by
//   PYTHONPATH=.diffusers/src python3 tools/parity/qwen_image_fixtures.py
//     --out tests/fixtures/qwen_image
// with diffusers v0.39.0, torch 2.11, peft 0.21; f32): output, loss and every LoRA gradient
// within 1e-4 relative, resident and streamed, with and without a padded caption's mask;
// checkpointed blocks give plain autograd's gradients; streamed blocks equal resident ones
// bit for bit (poisoned and delayed copies); the single file (bare or prefixed names) and the
// diffusers folder read the same weights; bad checkpoints are refused naming the tensor.
#include "tests/worker/torch_catch.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/base/error.h"
#include "common/formats/qwen_image_cache.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/qwen_image_layout.h"
#include "common/formats/safetensors.h"
#include "store/synth.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/test_support.h"
#include "tests/worker/dit_taped_steps.h"
#include "worker/model/flow_match.h"
#include "worker/qwen_image/qwen_image_adapter_io.h"
#include "worker/qwen_image/qwen_image_base.h"
#include "worker/qwen_image/qwen_image_data.h"
#include "worker/qwen_image/qwen_image_model.h"
#include "worker/train/adamw.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::qwen_image;
using lorastream::testing::ErrorMessageOf;
using lorastream::testing::TempDir;

namespace {

const std::string kFixtures = std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/qwen_image/";

at::Tensor Get(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsEntry* e = f.Find(name);
  if (e == nullptr) throw std::runtime_error(f.path() + ": no tensor " + name);
  REQUIRE(e->dtype == DType::kF32);
  return at::from_blob(const_cast<uint8_t*>(f.Data(*e)), e->shape, at::kFloat).clone();
}

QwenImageBatch CaseBatch(const SafetensorsFile& c) {
  QwenImageBatch b;
  b.img = Get(c, "img");
  b.txt = Get(c, "txt");
  b.timesteps = Get(c, "timesteps");
  if (Get(c, "use_mask").item<float>() > 0.5f) b.txt_mask = Get(c, "txt_mask") > 0.5;
  const at::Tensor grid = Get(c, "grid");
  b.grid_h = static_cast<int64_t>(grid[0].item<float>());
  b.grid_w = static_cast<int64_t>(grid[1].item<float>());
  return b;
}

struct LossAndGrads {
  at::Tensor output, loss;
  std::vector<at::Tensor> grads;  // per A and B in Params() order; zeros where none reached
};

LossAndGrads Run(QwenImageModel& model, const QwenImageBatch& batch, QwenImageAdapter& adapter,
                 bool checkpointed, const at::Tensor& target) {
  for (auto& p : adapter.Params())
    if (p.grad().defined()) p.mutable_grad().zero_();
  model.provider().BeginStep();
  LossAndGrads r;
  r.output = model.Forward(batch, adapter, checkpointed);
  r.loss = (r.output - target).pow(2).mean();
  r.loss.backward();
  StepStats stats;
  model.provider().EndStep(stats);
  for (auto& p : adapter.Params())
    r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return r;
}

// max |got - want| relative to max |want|; an all-zero `want` asks `got` to be below 1e-9.
double RelErr(const at::Tensor& got, const at::Tensor& want) {
  const double scale = want.abs().max().item<double>();
  const double diff = (got - want).abs().max().item<double>();
  return scale == 0 ? (diff < 1e-9 ? 0 : 1) : diff / scale;
}

// An adapter on `targets` with B random too (B = 0 would give A no gradient).
QwenImageAdapter RandomAdapter(const QwenImageConfig& c, const std::string& targets,
                               uint64_t seed) {
  QwenImageAdapter a(c, QwenImageTargets({targets}, "test"), 4, 8.0, seed, at::kCPU);
  at::Generator gen = at::detail::createCPUGenerator(seed + 1);
  c10::NoGradGuard no_grad;
  for (auto& [name, m] : a.modules()) m.b.normal_(0, 0.05, gen);
  return a;
}

// Every tensor of a safetensors file, copied (name, dtype, shape, bytes).
struct FileTensors {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<uint8_t>> bytes;
  std::map<std::string, std::string> metadata;
};

FileTensors ReadAll(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::Open(path);
  FileTensors out;
  out.metadata = f.header().metadata;
  for (const auto& e : f.tensors()) {
    out.names.push_back(e.name);
    out.shapes.push_back(e.shape);
    const uint8_t* d = f.Data(e);
    out.bytes.emplace_back(d, d + e.nbytes());
  }
  return out;
}

void WriteAll(const std::string& path, const FileTensors& t) {
  std::vector<TensorToWrite> w;
  for (size_t i = 0; i < t.names.size(); ++i)
    w.push_back({t.names[i], DType::kF32, t.shapes[i], t.bytes[i].data()});
  WriteSafetensors(path, w, t.metadata);
}

}  // namespace

TEST_CASE("qwen_image parity: output, loss and LoRA gradients equal diffusers + peft (f32)",
          "[worker][qwen_image][parity]") {
  REQUIRE(std::filesystem::exists(kFixtures + "qwen_image_fixtures.json"));
  for (const auto& [name, targets] :
       std::vector<std::pair<std::string, std::string>>{{"qi_l2", "default"}, {"qi_l3m", "all"}}) {
    INFO(name);
    const QwenImageBase base =
        QwenImageBase::Load(kFixtures + name + "_model.safetensors", at::kFloat, at::kCPU);
    const SafetensorsFile c = SafetensorsFile::Open(kFixtures + name + "_case.safetensors");
    QwenImageAdapter adapter(base.config(), QwenImageTargets({targets}, "test"), 4, 8.0, 0,
                             at::kCPU);
    {
      c10::NoGradGuard no_grad;
      for (auto& [module, m] : adapter.modules()) {
        m.a.copy_(Get(c, module + ".lora_A"));
        m.b.copy_(Get(c, module + ".lora_B"));
      }
    }
    const QwenImageBatch batch = CaseBatch(c);
    CHECK(batch.txt_mask.defined() == (name == "qi_l3m"));
    const int units = static_cast<int>(base.layouts().size());
    for (int swap : {0, units}) {
      INFO(swap << " of " << units << " blocks streamed");
      auto engine = base.MakeEngine(swap, 1, at::kCPU);
      QwenImageModel model(base.config(), base.rest(), engine.get(), at::kCPU, at::kFloat);
      const LossAndGrads r = Run(model, batch, adapter, true, Get(c, "target"));
      CHECK(RelErr(r.output, Get(c, "output")) < 1e-4);
      CHECK(RelErr(r.loss.reshape({1}), Get(c, "loss")) < 1e-4);
      size_t k = 0;
      for (const auto& [module, m] : adapter.modules()) {
        INFO(module);
        CHECK(RelErr(r.grads[k++], Get(c, module + ".grad_A")) < 1e-4);
        CHECK(RelErr(r.grads[k++], Get(c, module + ".grad_B")) < 1e-4);
      }
    }
  }
}

TEST_CASE("qwen_image: checkpointed blocks give plain autograd's loss and gradients",
          "[worker][qwen_image]") {
  const QwenImageBase base =
      QwenImageBase::Load(kFixtures + "qi_l3m_model.safetensors", at::kFloat, at::kCPU);
  const SafetensorsFile c = SafetensorsFile::Open(kFixtures + "qi_l3m_case.safetensors");
  auto engine = base.MakeEngine(0, 1, at::kCPU);
  QwenImageModel model(base.config(), base.rest(), engine.get(), at::kCPU, at::kFloat);
  QwenImageAdapter adapter = RandomAdapter(base.config(), "all", 11);
  const QwenImageBatch batch = CaseBatch(c);
  const at::Tensor target = Get(c, "target");
  const LossAndGrads plain = Run(model, batch, adapter, false, target);
  const LossAndGrads ckpt = Run(model, batch, adapter, true, target);
  CHECK(plain.loss.item<double>() == ckpt.loss.item<double>());
  double max_rel = 0;
  int reached = 0;
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    if (plain.grads[i].abs().sum().item<double>() > 0) ++reached;
    max_rel = std::max(max_rel, RelErr(ckpt.grads[i], plain.grads[i]));
  }
  // Every A and B but those of the last block's text-only modules (add_q_proj, to_add_out,
  // txt_mlp's two: the text stream's output reaches no prediction) gets a gradient.
  CHECK(reached == static_cast<int>(plain.grads.size()) - 2 * 4);
  CHECK(max_rel < 1e-5);
}

TEST_CASE(
    "qwen_image: streamed blocks equal the resident run bit for bit (rings, poisoned and "
    "delayed copies)",
    "[worker][qwen_image]") {
  const QwenImageBase base =
      QwenImageBase::Load(kFixtures + "qi_l3m_model.safetensors", at::kFloat, at::kCPU);
  const QwenImageConfig& cfg = base.config();
  const SafetensorsFile c = SafetensorsFile::Open(kFixtures + "qi_l3m_case.safetensors");
  const QwenImageBatch batch = CaseBatch(c);
  const at::Tensor target = Get(c, "target");
  auto resident_engine = base.MakeEngine(0, 1, at::kCPU);
  QwenImageModel resident(cfg, base.rest(), resident_engine.get(), at::kCPU, at::kFloat);
  QwenImageAdapter adapter = RandomAdapter(cfg, "default", 3);
  const LossAndGrads want = Run(resident, batch, adapter, true, target);
  const int units = static_cast<int>(cfg.num_layers);
  for (int swap : {units, units - 1}) {
    for (int ring : {1, 2}) {
      StreamEngineOptions o;
      o.debug_poison = true;
      o.debug_copy_delay_us = 200;
      o.log_plan = false;
      auto engine = base.MakeEngine(swap, ring, at::kCPU, o);
      QwenImageModel streamed(cfg, base.rest(), engine.get(), at::kCPU, at::kFloat);
      for (int step = 0; step < 2; ++step) {
        INFO(swap << " of " << units << " streamed, ring " << ring << ", step " << step);
        const LossAndGrads got = Run(streamed, batch, adapter, true, target);
        CHECK(at::equal(got.loss, want.loss));
        for (size_t i = 0; i < want.grads.size(); ++i)
          REQUIRE(at::equal(got.grads[i], want.grads[i]));
      }
    }
  }
}

TEST_CASE(
    "qwen_image: taped blocks equal checkpointed ones bit for bit (alone and in a group of two, "
    "resident and beside streamed blocks, over AdamW steps)",
    "[worker][qwen_image]") {
  const QwenImageBase base =
      QwenImageBase::Load(kFixtures + "qi_l3m_model.safetensors", at::kFloat, at::kCPU);
  const QwenImageConfig& cfg = base.config();
  const SafetensorsFile c = SafetensorsFile::Open(kFixtures + "qi_l3m_case.safetensors");
  QwenImageBatch batches[2] = {CaseBatch(c), CaseBatch(c)};
  batches[1].img = batches[1].img.flip(1);  // another job's latents and timesteps
  batches[1].timesteps = batches[1].timesteps * 0.5;
  const at::Tensor targets[2] = {Get(c, "target"), Get(c, "target").flip(1)};
  const int units = static_cast<int>(cfg.num_layers);
  REQUIRE(units >= 3);
  // `jobs` jobs trained together for three AdamW steps, `swap` blocks streamed through one
  // slot, the last `taped` resident blocks taped.
  auto train = [&](int jobs, int swap, int taped) {
    const ResidencyPlan plan = lorastream::testing::TapedPlan(units, swap, taped);
    auto engine = base.MakeEngine(plan, at::kCPU, lorastream::testing::TapedEngineOptions(plan));
    QwenImageModel model(cfg, base.rest(), engine.get(), at::kCPU, at::kFloat);
    model.SetTapedUnits(TapedBlocks(plan));
    std::vector<QwenImageAdapter> adapters;
    for (int j = 0; j < jobs; ++j) adapters.push_back(RandomAdapter(cfg, "all", 11 + j));
    const lorastream::testing::GroupJobs<QwenImageBatch, QwenImageAdapter> group(jobs, batches,
                                                                                 adapters);
    return lorastream::testing::TrainSteps(*engine, group.params, 3, [&] {
      const std::vector<at::Tensor> preds =
          model.ForwardGroup(group.batches, group.adapters, /*checkpointed=*/true);
      // The taped blocks ran under plain autograd.
      lorastream::testing::CheckTapedGraph(preds[0], units, taped);
      std::vector<at::Tensor> losses;
      for (int j = 0; j < jobs; ++j) losses.push_back((preds[j] - targets[j]).pow(2).mean());
      return losses;
    });
  };
  for (int jobs : {1, 2}) {
    for (int swap : {0, 1}) {
      const auto want = train(jobs, swap, 0);
      for (int taped : {1, units - swap}) {
        INFO(jobs << " job(s), " << swap << " blocks streamed, " << taped << " taped");
        lorastream::testing::CheckSameSteps(train(jobs, swap, taped), want);
      }
    }
  }
}

TEST_CASE("qwen_image: the single file (bare or prefixed) and the diffusers folder read alike",
          "[worker][qwen_image]") {
  TempDir dir("qwen-image-forms");
  const std::string bare = kFixtures + "qi_l2_model.safetensors";
  FileTensors t = ReadAll(bare);
  // ComfyUI's prefixed form of the same weights.
  FileTensors prefixed = t;
  for (auto& n : prefixed.names) n = "model.diffusion_model." + n;
  WriteAll(dir.str() + "/prefixed.safetensors", prefixed);
  // The diffusers folder: transformer/config.json and two shards with their index.
  const QwenImageConfig cfg = QwenImageCheckpointReader::Open(bare).config();
  const std::string tdir = dir.str() + "/folder/transformer";
  std::filesystem::create_directories(tdir);
  std::ofstream(tdir + "/config.json") << QwenImageConfigJson(cfg);
  FileTensors first, second;
  std::string weight_map;
  for (size_t i = 0; i < t.names.size(); ++i) {
    FileTensors& shard = i % 2 ? second : first;
    shard.names.push_back(t.names[i]);
    shard.shapes.push_back(t.shapes[i]);
    shard.bytes.push_back(t.bytes[i]);
    weight_map += std::string(weight_map.empty() ? "" : ",") + "\"" + t.names[i] +
                  "\": \"diffusion_pytorch_model-0000" + (i % 2 ? "2" : "1") +
                  "-of-00002.safetensors\"";
  }
  WriteAll(tdir + "/diffusion_pytorch_model-00001-of-00002.safetensors", first);
  WriteAll(tdir + "/diffusion_pytorch_model-00002-of-00002.safetensors", second);
  std::ofstream(tdir + "/diffusion_pytorch_model.safetensors.index.json")
      << "{\"metadata\": {}, \"weight_map\": {" << weight_map << "}}";

  CHECK(IsQwenImageCheckpointPath(bare));
  CHECK(IsQwenImageCheckpointPath(dir.str() + "/folder"));
  CHECK_FALSE(IsQwenImageCheckpointPath(dir.str()));
  const QwenImageBase want = QwenImageBase::Load(bare, at::kFloat, at::kCPU);
  for (const std::string& path :
       {dir.str() + "/prefixed.safetensors", dir.str() + "/folder", tdir}) {
    INFO(path);
    const QwenImageBase got = QwenImageBase::Load(path, at::kFloat, at::kCPU);
    CHECK(got.config().num_layers == 2);
    CHECK(got.config().axes_dim == want.config().axes_dim);
    REQUIRE(got.layouts().size() == want.layouts().size());
    for (size_t u = 0; u < got.layouts().size(); ++u)
      CHECK(std::memcmp(got.unit_bytes()[u], want.unit_bytes()[u], got.layouts()[u].nbytes) == 0);
    for (const auto& [name, tensor] : want.rest()) CHECK(at::equal(got.rest().at(name), tensor));
  }
}

TEST_CASE("qwen_image: bad checkpoints are refused naming the tensor or the key",
          "[worker][qwen_image]") {
  TempDir dir("qwen-image-bad");
  const FileTensors t = ReadAll(kFixtures + "qi_l2_model.safetensors");
  auto load_with = [&](const std::function<void(FileTensors&)>& edit) {
    FileTensors copy = t;
    edit(copy);
    const std::string path = dir.str() + "/bad.safetensors";
    WriteAll(path, copy);
    return ErrorMessageOf([&] { QwenImageBase::Load(path, at::kFloat, at::kCPU); });
  };
  auto index_of = [&](const FileTensors& f, const std::string& name) {
    for (size_t i = 0; i < f.names.size(); ++i)
      if (f.names[i] == name) return i;
    FAIL("no tensor " << name);
    return size_t{0};
  };
  CHECK_THAT(load_with([&](FileTensors& f) {
               const size_t i = index_of(f, "transformer_blocks.1.attn.to_k.bias");
               f.names.erase(f.names.begin() + i);
               f.shapes.erase(f.shapes.begin() + i);
               f.bytes.erase(f.bytes.begin() + i);
             }),
             Catch::Contains("missing tensor `transformer_blocks.1.attn.to_k.bias`"));
  CHECK_THAT(load_with([&](FileTensors& f) {
               f.names.push_back("transformer_blocks.0.attn.extra.weight");
               f.shapes.push_back({2});
               f.bytes.push_back(std::vector<uint8_t>(8, 0));
             }),
             Catch::Contains("unexpected tensor `transformer_blocks.0.attn.extra.weight`"));
  CHECK_THAT(load_with([&](FileTensors& f) {
               const size_t i = index_of(f, "transformer_blocks.0.img_mlp.net.2.bias");
               f.shapes[i] = {f.shapes[i][0] / 2, 2};
             }),
             Catch::Contains("tensor `transformer_blocks.0.img_mlp.net.2.bias` has shape"));
  CHECK_THAT(load_with([&](FileTensors& f) {
               f.names[index_of(f, "img_in.bias")] = "diffusion_model.img_in.bias";
             }),
             Catch::Contains("missing tensor `img_in.bias`"));
  CHECK_THAT(load_with([&](FileTensors& f) {
               const size_t i = index_of(f, "img_in.weight");
               f.names[i] = "x_embedder.weight";
             }),
             Catch::Contains("no tensor `img_in.weight`"));
  CHECK_THAT(load_with([&](FileTensors& f) {
               f.names.push_back("transformer_blocks.x7.attn.to_q.weight");
               f.shapes.push_back({2});
               f.bytes.push_back(std::vector<uint8_t>(8, 0));
             }),
             Catch::Contains("block index `x7` is not a number"));
  CHECK_THAT(load_with([&](FileTensors& f) { f.metadata.erase("qwen_image.axes_dim"); }),
             Catch::Contains("no qwen_image.axes_dim"));
  CHECK_THAT(load_with([&](FileTensors& f) { f.metadata["qwen_image.axes_dim"] = "4,6,5"; }),
             Catch::Contains("`qwen_image.axes_dim`"));

  std::ofstream(dir.str() + "/notes.txt") << "x";
  CHECK_THAT(
      ErrorMessageOf([&] { QwenImageBase::Load(dir.str() + "/notes.txt", at::kFloat, at::kCPU); }),
      Catch::Contains("not a .safetensors file"));
  const std::string folder = dir.str() + "/folder";
  std::filesystem::create_directories(folder + "/transformer");
  CHECK_THAT(ErrorMessageOf([&] { QwenImageBase::Load(folder, at::kFloat, at::kCPU); }),
             Catch::Contains("without a QwenImageTransformer2DModel config.json"));
  QwenImageConfig cfg;
  cfg.num_layers = 2;
  std::string json = QwenImageConfigJson(cfg);
  json.replace(json.find("\"zero_cond_t\": false"), 20, "\"zero_cond_t\": true");
  std::ofstream(folder + "/transformer/config.json") << json;
  CHECK_THAT(ErrorMessageOf([&] { QwenImageBase::Load(folder, at::kFloat, at::kCPU); }),
             Catch::Contains("`zero_cond_t` is true"));
  std::ofstream(folder + "/transformer/config.json") << QwenImageConfigJson(cfg);
  CHECK_THAT(ErrorMessageOf([&] { QwenImageBase::Load(folder, at::kFloat, at::kCPU); }),
             Catch::Contains("diffusion_pytorch_model"));
  CHECK_THAT(
      ErrorMessageOf([&] { QwenImageBase::Load(dir.str() + "/none", at::kFloat, at::kCPU); }),
      Catch::Contains("does not exist"));
}

TEST_CASE("qwen_image: LoRA targets as musubi-tuner's defaults, attention-only, all, or named",
          "[worker][qwen_image]") {
  const auto def = QwenImageTargets({"default"}, "lora.targets");
  CHECK(def.size() == 12);
  CHECK(std::find(def.begin(), def.end(), "img_mod.1") == def.end());
  CHECK(std::find(def.begin(), def.end(), "txt_mlp.net.2") != def.end());
  const auto attn = QwenImageTargets({"attention"}, "lora.targets");
  CHECK(attn == std::vector<std::string>{"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                         "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                                         "attn.to_add_out"});
  CHECK(QwenImageTargets({"all"}, "lora.targets").size() == 14);
  CHECK_THAT(ErrorMessageOf([] { QwenImageTargets({"attn.to_qkv"}, "job.toml: lora.targets"); }),
             Catch::Contains("job.toml: lora.targets: `attn.to_qkv` is not a linear layer of a "
                             "Qwen-Image block"));
  CHECK(IsQwenImageBlockLinearWeight("transformer_blocks.59.img_mlp.net.0.proj.weight"));
  CHECK_FALSE(IsQwenImageBlockLinearWeight("transformer_blocks.5.attn.norm_q.weight"));
  CHECK_FALSE(IsQwenImageBlockLinearWeight("img_in.weight"));
}

TEST_CASE(
    "qwen_image data: musubi-tuner's caches read as they are, batched by bucket, padded "
    "captions masked",
    "[worker][qwen_image]") {
  TempDir dir("qwen-image-cache");
  const QwenImageConfig cfg =
      QwenImageCheckpointReader::Open(kFixtures + "qi_l2_model.safetensors").config();
  // Two 32x32-pixel images (captions of 5 and 3 tokens) and one of 48x32: two buckets.
  WriteQwenImageCacheFiles(dir.str(), "cat", 32, 32, 5, cfg.joint_attention_dim, 1);
  WriteQwenImageCacheFiles(dir.str(), "dog", 32, 32, 3, cfg.joint_attention_dim, 2);
  WriteQwenImageCacheFiles(dir.str(), "wide", 48, 32, 4, cfg.joint_attention_dim, 3, DType::kF32);
  const QwenImageDataset data(dir.str(), cfg);
  CHECK(data.size() == 3);
  CHECK(data.buckets() == 2);
  CHECK(data.max_text_tokens() == 5);
  CHECK(data.largest_latent() == std::pair<int64_t, int64_t>{4, 6});
  CHECK(data.batches_per_epoch(2) == 2);
  bool saw_pair = false;
  for (int64_t step = 0; step < 4; ++step) {
    const QwenImageDataBatch b = data.Batch(step, 2, 7);
    INFO("step " << step);
    if (b.names.size() == 2) {
      saw_pair = true;
      CHECK(b.latents.sizes() == at::IntArrayRef({2, 16, 4, 4}));
      REQUIRE(b.txt_mask.defined());
      CHECK(b.embeds.size(1) == 5);
      for (int j = 0; j < 2; ++j) {
        const int64_t len = b.names[j] == "cat" ? 5 : 3;
        CHECK(b.txt_mask[j].sum().item<int64_t>() == len);
        CHECK(b.embeds[j].narrow(0, len, 5 - len).abs().sum().item<double>() == 0);
        CHECK(b.embeds[j].narrow(0, 0, len).abs().sum().item<double>() > 0);
      }
    } else {
      CHECK(b.names == std::vector<std::string>{"wide"});
      CHECK(b.latents.sizes() == at::IntArrayRef({1, 16, 4, 6}));
      CHECK_FALSE(b.txt_mask.defined());
    }
    // The same step of the same seed: the same batch, noise and timesteps.
    const dit::TimestepSampling sampling{"shift", 1.0, 2.2};
    const QwenImageStepInput x = MakeQwenImageStep(b, 7, step, sampling, at::kCPU, at::kFloat);
    const QwenImageStepInput y =
        MakeQwenImageStep(data.Batch(step, 2, 7), 7, step, sampling, at::kCPU, at::kFloat);
    CHECK(at::equal(x.batch.img, y.batch.img));
    CHECK(at::equal(x.target, y.target));
    CHECK(x.batch.img.size(1) == x.batch.grid_h * x.batch.grid_w);
  }
  CHECK(saw_pair);
}

TEST_CASE("qwen_image data: bad or mismatched cache files are refused naming the file",
          "[worker][qwen_image]") {
  TempDir dir("qwen-image-bad-cache");
  const QwenImageConfig cfg =
      QwenImageCheckpointReader::Open(kFixtures + "qi_l2_model.safetensors").config();
  auto refused = [&](const std::function<void(const std::string&)>& make) {
    std::filesystem::remove_all(dir.path() / "c");
    std::filesystem::create_directories(dir.path() / "c");
    make(dir.str() + "/c");
    return ErrorMessageOf([&] { QwenImageDataset(dir.str() + "/c", cfg); });
  };
  const int64_t jd = cfg.joint_attention_dim;
  CHECK_THAT(refused([&](const std::string& d) {
               WriteQwenImageCacheFiles(d, "cat", 32, 32, 5, jd, 1);
               std::filesystem::remove(d + "/cat_qi_te.safetensors");
             }),
             Catch::Contains("cat_0032x0032_qi.safetensors: no text-encoder file "
                             "cat_qi_te.safetensors"));
  CHECK_THAT(refused([&](const std::string& d) {
               WriteQwenImageCacheFiles(d, "cat", 32, 32, 5, jd + 1, 1);
             }),
             Catch::Contains("cat_qi_te.safetensors: tensor `varlen_vl_embed_bfloat16` has shape "
                             "[5, 25], expected [L, 24]"));
  CHECK_THAT(refused([&](const std::string&) {}), Catch::Contains("no Qwen-Image latent cache"));
  const std::vector<float> v(16 * 4 * 4, 0.5f);
  auto latent_file = [&](const std::string& d, const std::string& key, std::vector<int64_t> shape,
                         const std::string& arch) {
    WriteQwenImageCacheFiles(d, "cat", 32, 32, 5, jd, 1);
    WriteSafetensors(d + "/cat_0032x0032_qi.safetensors", {{key, DType::kF32, shape, v.data()}},
                     {{"architecture", arch}});
  };
  CHECK_THAT(refused([&](const std::string& d) {
               latent_file(d, "latents_1x4x4_float32", {16, 1, 4, 4}, "qwen_image_edit");
             }),
             Catch::Contains("cat_0032x0032_qi.safetensors: metadata `architecture` is "
                             "`qwen_image_edit`"));
  CHECK_THAT(refused([&](const std::string& d) {
               latent_file(d, "latents_1x4x4_bfloat16", {16, 1, 4, 4}, "qwen_image");
             }),
             Catch::Contains("tensor `latents_1x4x4_bfloat16` is F32"));
  CHECK_THAT(refused([&](const std::string& d) {
               latent_file(d, "latents_1x8x2_float32", {16, 1, 4, 4}, "qwen_image");
             }),
             Catch::Contains("is not named for it (`latents_1x4x4_float32`)"));
  CHECK_THAT(refused([&](const std::string& d) {
               latent_file(d, "latents_1x4x4_float32", {4, 4, 4, 4}, "qwen_image");
             }),
             Catch::Contains("has shape [4, 4, 4, 4], expected [16, 1, h, w]"));
  CHECK_THAT(refused([&](const std::string& d) {
               latent_file(d, "latents_control_0_1x4x4_float32", {16, 1, 4, 4}, "qwen_image");
             }),
             Catch::Contains("control latents"));
}

TEST_CASE("qwen_image objective: qwen_shift and shift as musubi-tuner computes them",
          "[worker][qwen_image]") {
  CHECK(dit::QwenShiftMu(256) == Approx(0.5));
  CHECK(dit::QwenShiftMu(8192) == Approx(0.9));
  CHECK(dit::QwenShiftMu(4096) == Approx(0.5 + 0.4 * 3840.0 / 7936.0));
  for (const std::string method : {"shift", "qwen_shift"}) {
    at::Generator g1 = at::detail::createCPUGenerator(3), g2 = at::detail::createCPUGenerator(3);
    const at::Tensor t = dit::SampleTimesteps({method, 1.0, 2.2}, 64, 128, 128, g1);
    const at::Tensor s = at::sigmoid(at::empty({64}, at::kFloat).normal_(0.0, 1.0, g2));
    const double k = method == "shift" ? 2.2 : std::exp(dit::QwenShiftMu(64 * 64));
    CHECK(at::allclose(t, s * k / (1 + (k - 1) * s)));
  }
}

TEST_CASE("qwen_image: AdamW on the LoRA weights lowers the loss on cached images, streamed",
          "[worker][qwen_image]") {
  TempDir dir("qwen-image-train");
  const QwenImageBase base =
      QwenImageBase::Load(kFixtures + "qi_l2_model.safetensors", at::kFloat, at::kCPU);
  const QwenImageConfig& cfg = base.config();
  WriteQwenImageCacheFiles(dir.str(), "cat", 32, 32, 5, cfg.joint_attention_dim, 1);
  WriteQwenImageCacheFiles(dir.str(), "dog", 32, 32, 3, cfg.joint_attention_dim, 2);
  const QwenImageDataset data(dir.str(), cfg);
  auto engine = base.MakeEngine(cfg.num_layers, 1, at::kCPU);
  QwenImageModel model(cfg, base.rest(), engine.get(), at::kCPU, at::kFloat);
  QwenImageAdapter adapter(cfg, QwenImageTargets({"default"}, "test"), 4, 4.0, 1, at::kCPU);
  AdamW optimizer(adapter.Params(), AdamWOptions{});
  const QwenImageStepInput in =
      MakeQwenImageStep(data.Batch(0, 2, 0), 0, 0, {"shift", 1.0, 2.2}, at::kCPU, at::kFloat);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    model.provider().BeginStep();
    const at::Tensor loss = dit::FlowLoss(model.Forward(in.batch, adapter, true), in.target);
    loss.backward();
    StepStats stats;
    model.provider().EndStep(stats);
    (step == 0 ? first : last) = loss.item<double>();
    optimizer.Step(1e-2);
    optimizer.ZeroGrad();
  }
  INFO("loss " << first << " -> " << last);
  CHECK(last < 0.9 * first);
}

TEST_CASE("qwen_image adapters: ComfyUI's and diffusers' names, peft's keys and values",
          "[worker][qwen_image]") {
  TempDir dir("qwen-image-adapter");
  const std::string name = "qi_l3m";
  const QwenImageConfig cfg =
      QwenImageCheckpointReader::Open(kFixtures + name + "_model.safetensors").config();
  const SafetensorsFile c = SafetensorsFile::Open(kFixtures + name + "_case.safetensors");
  QwenImageAdapter adapter(cfg, QwenImageTargets({"all"}, "test"), 4, 8.0, 0, at::kCPU);
  {
    c10::NoGradGuard no_grad;
    for (auto& [module, m] : adapter.modules()) {
      m.a.copy_(Get(c, module + ".lora_A"));
      m.b.copy_(Get(c, module + ".lora_B"));
    }
  }
  SaveQwenImageAdapters(adapter, dir.str());
  // diffusers: peft's keys exactly (the fixture's file is get_peft_model_state_dict's with the
  // "transformer." prefix), A as it is and B times alpha / r (read with lora_alpha = r).
  const SafetensorsFile peft = SafetensorsFile::Open(kFixtures + name + "_peft.safetensors");
  const SafetensorsFile ours = SafetensorsFile::Open(dir.str() + "/" + kQwenDiffusersAdapterFile);
  REQUIRE(ours.tensors().size() == peft.tensors().size());
  for (const auto& e : peft.tensors()) {
    INFO(e.name);
    REQUIRE(ours.Find(e.name) != nullptr);
    const bool is_b = e.name.find(".lora_B.") != std::string::npos;
    CHECK(at::allclose(Get(ours, e.name), Get(peft, e.name) * (is_b ? 2.0 : 1.0)));
  }
  // ComfyUI: diffusion_model.<module>.lora_down / lora_up / alpha, read back exactly.
  const SafetensorsFile comfy = SafetensorsFile::Open(dir.str() + "/" + kComfyAdapterFile);
  CHECK(comfy.tensors().size() == 3 * adapter.modules().size());
  CHECK(comfy.Find("diffusion_model.transformer_blocks.2.txt_mod.1.lora_up.weight") != nullptr);
  CHECK(Get(comfy, "diffusion_model.transformer_blocks.0.attn.to_add_out.alpha").item<float>() ==
        8.0f);
  QwenImageAdapter back(cfg, QwenImageTargets({"all"}, "test"), 4, 8.0, 99, at::kCPU);
  LoadComfyAdapter(dir.str() + "/" + kComfyAdapterFile, back);
  for (const auto& [module, m] : adapter.modules()) {
    CHECK(at::equal(back.modules().at(module).a, m.a));
    CHECK(at::equal(back.modules().at(module).b, m.b));
  }
  QwenImageAdapter other_alpha(cfg, QwenImageTargets({"all"}, "test"), 4, 4.0, 0, at::kCPU);
  CHECK_THAT(
      ErrorMessageOf([&] { LoadComfyAdapter(dir.str() + "/" + kComfyAdapterFile, other_alpha); }),
      Catch::Contains(".alpha` is 8"));
}

TEST_CASE("qwen_image synth: a tiny random Qwen-Image in ComfyUI's and diffusers' forms, alike",
          "[worker][qwen_image]") {
  TempDir dir("qwen-image-synth");
  std::vector<std::string> paths;
  for (const std::string format : {"comfyui", "comfyui-prefixed", "diffusers"}) {
    store::SynthOptions o;
    o.preset = "qwen-image-tiny";
    o.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
    o.out_dir = dir.str() + "/" + format;
    o.qwen_image_format = format;
    o.seed = 5;
    store::RunSynth(o);
    paths.push_back(format == "diffusers" ? o.out_dir : o.out_dir + "/qwen_image.safetensors");
    CHECK(IsQwenImageCheckpointPath(paths.back()));
  }
  const QwenImageBase want = QwenImageBase::Load(paths[0], at::kFloat, at::kCPU);
  CHECK(want.config().num_layers == 2);
  CHECK(want.config().hidden() == 32);
  for (size_t i = 1; i < paths.size(); ++i) {
    INFO(paths[i]);
    const QwenImageBase got = QwenImageBase::Load(paths[i], at::kFloat, at::kCPU);
    for (size_t u = 0; u < got.layouts().size(); ++u)
      CHECK(std::memcmp(got.unit_bytes()[u], want.unit_bytes()[u], got.layouts()[u].nbytes) == 0);
    for (const auto& [name, tensor] : want.rest()) CHECK(at::equal(got.rest().at(name), tensor));
  }
  store::SynthOptions bad;
  bad.preset = "qwen-image-tiny";
  bad.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  bad.out_dir = dir.str() + "/bad";
  bad.qwen_image_format = "bfl";
  CHECK_THAT(ErrorMessageOf([&] { store::RunSynth(bad); }),
             Catch::Contains("--qwen-image-format `bfl`"));
}
