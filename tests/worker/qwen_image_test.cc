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
#include <set>

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
  // An edit case's control images: packed latents after the image's, one grid per image.
  if (c.Find("control") != nullptr) {
    b.control = Get(c, "control");
    const at::Tensor grids = Get(c, "control_grids");
    for (int64_t k = 0; k < grids.size(0); ++k)
      b.control_grids.emplace_back(static_cast<int64_t>(grids[k][0].item<float>()),
                                   static_cast<int64_t>(grids[k][1].item<float>()));
  }
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
  // qie_*: Qwen-Image-Edit's, one control image (qie_l2) and Edit-2509's two (qie_l3m).
  for (const auto& [name, targets] : std::vector<std::pair<std::string, std::string>>{
           {"qi_l2", "default"}, {"qi_l3m", "all"}, {"qie_l2", "default"}, {"qie_l3m", "all"}}) {
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
    CHECK(batch.txt_mask.defined() == (name.substr(name.size() - 1) == "m"));
    CHECK(batch.control_grids.size() == (name == "qie_l2" ? 1u : name == "qie_l3m" ? 2u : 0u));
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

namespace {

// The qi_l3m case as a Qwen-Image-Edit batch: its image and padded captions, then two control
// images of other grids (Edit-2509's several; the first larger than the image's 3 x 5, so that
// the text's positions move), random latents from `seed`.
QwenImageBatch EditBatch(const SafetensorsFile& c, uint64_t seed) {
  QwenImageBatch b = CaseBatch(c);
  at::Generator g = at::detail::createCPUGenerator(seed);
  b.control_grids = {{4, 7}, {2, 3}};
  b.control = at::empty({b.img.size(0), 4 * 7 + 2 * 3, b.img.size(2)}).normal_(0, 1, g);
  return b;
}

}  // namespace

TEST_CASE(
    "qwen_image edit: control images at frames 1, 2, ... on their own centred grids, the text "
    "after the largest",
    "[worker][qwen_image]") {
  const QwenImageConfig cfg =
      QwenImageCheckpointReader::Open(kFixtures + "qi_l2_model.safetensors").config();
  const int64_t lt = 4, n = 3 * 5, nc = 4 * 7;
  const at::Tensor edit = QwenRopeTable(cfg, {{3, 5}, {4, 7}}, lt, at::kCPU);
  const at::Tensor image = QwenRopeTable(cfg, {{3, 5}}, lt, at::kCPU);
  const at::Tensor control = QwenRopeTable(cfg, {{4, 7}}, lt, at::kCPU);
  REQUIRE(edit.size(2) == lt + n + nc);
  // The image's tokens where they are alone; the text where the larger control puts it
  // (max(4/2, 7/2) = 3, not the image's 2).
  CHECK(at::equal(edit.narrow(2, lt, n), image.narrow(2, lt, n)));
  CHECK(at::equal(edit.narrow(2, 0, lt), control.narrow(2, 0, lt)));
  CHECK_FALSE(at::equal(image.narrow(2, 0, lt), control.narrow(2, 0, lt)));
  // The control's rows and columns as alone; its frame 1 where alone it is 0.
  const int64_t frame = cfg.axes_dim[0] / 2;
  const at::Tensor got = edit.narrow(2, lt + n, nc), alone = control.narrow(2, lt, nc);
  CHECK(at::equal(got.narrow(3, frame, got.size(3) - frame),
                  alone.narrow(3, frame, alone.size(3) - frame)));
  const at::Tensor inv = 1.0 / at::pow(cfg.theta, at::arange(0, cfg.axes_dim[0], 2, at::kFloat) /
                                                      static_cast<double>(cfg.axes_dim[0]));
  const at::Tensor cos1 = got.narrow(3, 0, frame).select(-1, 0).select(-1, 0);  // [1, 1, nc, f]
  CHECK(at::allclose(cos1, at::cos(inv).expand_as(cos1)));
  CHECK(at::equal(alone.narrow(3, 0, frame).select(-1, 0).select(-1, 0), at::ones_like(cos1)));
}

TEST_CASE(
    "qwen_image edit: control tokens reach attention; the prediction and loss are the image's "
    "tokens; checkpointed = plain autograd; streamed = resident bit for bit",
    "[worker][qwen_image]") {
  const QwenImageBase base =
      QwenImageBase::Load(kFixtures + "qi_l3m_model.safetensors", at::kFloat, at::kCPU);
  const QwenImageConfig& cfg = base.config();
  const SafetensorsFile c = SafetensorsFile::Open(kFixtures + "qi_l3m_case.safetensors");
  const at::Tensor target = Get(c, "target");
  auto resident_engine = base.MakeEngine(0, 1, at::kCPU);
  QwenImageModel resident(cfg, base.rest(), resident_engine.get(), at::kCPU, at::kFloat);
  QwenImageAdapter adapter = RandomAdapter(cfg, "all", 5);
  const QwenImageBatch edit = EditBatch(c, 1);
  const LossAndGrads plain = Run(resident, CaseBatch(c), adapter, true, target);
  const LossAndGrads want = Run(resident, edit, adapter, true, target);
  const LossAndGrads other = Run(resident, EditBatch(c, 2), adapter, true, target);
  // The image's tokens alone, whatever the controls; the controls change them, the loss and
  // the gradients.
  CHECK(want.output.sizes() == plain.output.sizes());
  CHECK(RelErr(want.output, plain.output) > 1e-3);
  CHECK(RelErr(other.output, want.output) > 1e-3);
  CHECK(want.loss.item<double>() != other.loss.item<double>());
  double grads_moved = 0;
  for (size_t i = 0; i < want.grads.size(); ++i)
    grads_moved = std::max(grads_moved, RelErr(other.grads[i], want.grads[i]));
  CHECK(grads_moved > 1e-3);
  // A padded caption's mask covers the longer image stream.
  QwenImageBatch unmasked = edit;
  unmasked.txt_mask = at::Tensor();
  CHECK(RelErr(Run(resident, unmasked, adapter, true, target).output, want.output) > 1e-6);
  SECTION("checkpointed blocks give plain autograd's loss and gradients") {
    const LossAndGrads taped = Run(resident, edit, adapter, false, target);
    CHECK(taped.loss.item<double>() == want.loss.item<double>());
    for (size_t i = 0; i < want.grads.size(); ++i)
      CHECK(RelErr(taped.grads[i], want.grads[i]) < 1e-5);
  }
  SECTION("streamed blocks equal resident ones bit for bit") {
    const int units = static_cast<int>(cfg.num_layers);
    for (int ring : {1, 2}) {
      StreamEngineOptions o;
      o.debug_poison = true;
      o.log_plan = false;
      auto engine = base.MakeEngine(units, ring, at::kCPU, o);
      QwenImageModel streamed(cfg, base.rest(), engine.get(), at::kCPU, at::kFloat);
      INFO("ring " << ring);
      const LossAndGrads got = Run(streamed, edit, adapter, true, target);
      CHECK(at::equal(got.output, want.output));
      CHECK(at::equal(got.loss, want.loss));
      for (size_t i = 0; i < want.grads.size(); ++i)
        REQUIRE(at::equal(got.grads[i], want.grads[i]));
    }
  }
  SECTION("a batch whose control tokens are not its grids' is refused") {
    QwenImageBatch bad = edit;
    bad.control_grids.pop_back();
    CHECK_THAT(ErrorMessageOf([&] { resident.Forward(bad, adapter, false); }),
               Catch::Contains("control tokens are its control grids'"));
  }
}

TEST_CASE(
    "qwen_image edit data: musubi-tuner's Qwen-Image-Edit caches with their control latents, "
    "batched by bucket and control sizes",
    "[worker][qwen_image]") {
  TempDir dir("qwen-image-edit-cache");
  const QwenImageConfig cfg =
      QwenImageCheckpointReader::Open(kFixtures + "qi_l2_model.safetensors").config();
  const int64_t jd = cfg.joint_attention_dim;
  // cat and dog: 32x32 with a 32x32 control; pair: 32x32 with two controls (Edit-2509);
  // wide: 48x32 with a 32x48 control. Three buckets.
  WriteQwenImageCacheFiles(dir.str(), "cat", 32, 32, 5, jd, 1, DType::kBF16, {{32, 32}});
  WriteQwenImageCacheFiles(dir.str(), "dog", 32, 32, 3, jd, 2, DType::kBF16, {{32, 32}});
  WriteQwenImageCacheFiles(dir.str(), "pair", 32, 32, 4, jd, 3, DType::kF32, {{32, 32}, {16, 48}});
  WriteQwenImageCacheFiles(dir.str(), "wide", 48, 32, 4, jd, 4, DType::kBF16, {{32, 48}});
  CHECK(std::filesystem::exists(dir.str() + "/pair_0032x0032_qie.safetensors"));
  CHECK(std::filesystem::exists(dir.str() + "/pair_qie_te.safetensors"));
  const QwenImageDataset data(dir.str(), cfg, /*edit=*/true);
  CHECK(data.size() == 4);
  CHECK(data.buckets() == 3);
  std::set<std::string> seen;
  for (int64_t step = 0; step < 6; ++step) {
    INFO("step " << step);
    const QwenImageDataBatch b = data.Batch(step, 2, 7);
    for (const auto& n : b.names) seen.insert(n);
    const QwenImageStepInput in =
        MakeQwenImageStep(b, 7, step, {"shift", 1.0, 2.2}, at::kCPU, at::kFloat);
    REQUIRE(in.batch.control.defined());
    CHECK(in.batch.control_grids.size() == b.controls.size());
    CHECK(in.image_tokens == in.batch.img.size(0) * in.batch.img.size(1));
    int64_t tokens = 0;
    for (size_t k = 0; k < b.controls.size(); ++k) {
      CHECK(b.controls[k].size(0) == static_cast<int64_t>(b.names.size()));
      tokens += b.controls[k].size(2) * b.controls[k].size(3) / 4;
    }
    CHECK(in.batch.control.size(1) == tokens);
    // The controls are packed clean (not noised), each image's after the previous one's.
    CHECK(
        at::equal(in.batch.control.narrow(1, 0, b.controls[0].size(2) * b.controls[0].size(3) / 4),
                  dit::PackLatents(b.controls[0])));
    if (b.names.size() == 2) {
      CHECK(b.controls.size() == 1);
      CHECK(b.controls[0].sizes() == at::IntArrayRef({2, 16, 4, 4}));
    } else if (b.names[0] == "pair") {
      REQUIRE(b.controls.size() == 2);
      CHECK(b.controls[1].sizes() == at::IntArrayRef({1, 16, 6, 2}));
      CHECK(in.batch.control_grids == std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {3, 1}});
    } else {
      CHECK(b.names[0] == "wide");
      CHECK(b.controls[0].sizes() == at::IntArrayRef({1, 16, 6, 4}));
    }
  }
  CHECK(seen.size() == 4);
  // The key and the caches must agree: each refused naming the key and a file of the folder.
  CHECK_THAT(ErrorMessageOf([&] { QwenImageDataset(dir.str(), cfg); }),
             Catch::Contains("holds Qwen-Image-Edit caches (" + dir.str() + "/") &&
                 Catch::Contains("_qie.safetensors") &&
                 Catch::Contains("set `qwen_image.edit = true`"));
  TempDir plain("qwen-image-plain-cache");
  WriteQwenImageCacheFiles(plain.str(), "cat", 32, 32, 5, jd, 1);
  CHECK_THAT(ErrorMessageOf([&] { QwenImageDataset(plain.str(), cfg, true); }),
             Catch::Contains("`qwen_image.edit = true` but the folder holds Qwen-Image caches") &&
                 Catch::Contains(plain.str() + "/cat_0032x0032_qi.safetensors"));
}

TEST_CASE("qwen_image edit data: bad or mismatched edit caches are refused naming the file",
          "[worker][qwen_image]") {
  TempDir dir("qwen-image-bad-edit-cache");
  const QwenImageConfig cfg =
      QwenImageCheckpointReader::Open(kFixtures + "qi_l2_model.safetensors").config();
  const int64_t jd = cfg.joint_attention_dim;
  const std::string d = dir.str() + "/c", latents = d + "/cat_0032x0032_qie.safetensors";
  // The cat's edit cache, then its latent file rewritten with `tensors` (f32 [16, 1, 4, 4]
  // unless the shape says otherwise).
  auto refused = [&](const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors) {
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    WriteQwenImageCacheFiles(d, "cat", 32, 32, 5, jd, 1, DType::kBF16, {{32, 32}});
    if (!tensors.empty()) {
      static const std::vector<float> v(16 * 8 * 8, 0.5f);
      std::vector<TensorToWrite> w;
      for (const auto& [name, shape] : tensors) w.push_back({name, DType::kF32, shape, v.data()});
      WriteSafetensors(latents, w, {{"architecture", "qwen_image"}});
    }
    return ErrorMessageOf([&] { QwenImageDataset(d, cfg, true); });
  };
  const std::vector<int64_t> s4{16, 1, 4, 4};
  CHECK(refused({}).empty());
  CHECK_THAT(refused({{"latents_1x4x4_float32", s4}}),
             Catch::Contains(latents + ": no control latents (`latents_control_0_"));
  CHECK_THAT(refused({{"latents_1x4x4_float32", s4}, {"latents_control_1_1x4x4_float32", s4}}),
             Catch::Contains(latents + ": no tensor `latents_control_0_1x{h}x{w}_{dtype}`"));
  CHECK_THAT(refused({{"latents_1x4x4_float32", s4}, {"latents_control_0_1x4x6_float32", s4}}),
             Catch::Contains("tensor `latents_control_0_1x4x6_float32` of shape [16, 1, 4, 4] is "
                             "not named for it (`latents_control_0_1x4x4_float32`)"));
  CHECK_THAT(
      refused({{"latents_1x4x4_float32", s4}, {"latents_control_0_1x3x4_float32", {16, 1, 3, 4}}}),
      Catch::Contains("latent 3x4 is not even"));
  CHECK_THAT(
      refused({{"latents_1x4x4_float32", s4}, {"latents_control_0_1x4x4_float32", {8, 1, 4, 4}}}),
      Catch::Contains("`latents_control_0_1x4x4_float32` has shape [8, 1, 4, 4], expected "
                      "[16, 1, h, w]"));
  CHECK_THAT(refused({{"latents_1x4x4_float32", s4}, {"latents_control_0_1x4x4_bfloat16", s4}}),
             Catch::Contains("tensor `latents_control_0_1x4x4_bfloat16` is F32"));
  CHECK_THAT(refused({{"latents_1x4x4_float32", s4}, {"latents_control_x_1x4x4_float32", s4}}),
             Catch::Contains("`latents_control_x_1x4x4_float32`: not a control latent of index"));
  CHECK_THAT(
      refused(
          {{"latents_1x4x4_float32", s4}, {"latents_control_0_1x4x4_float32", s4}, {"mask", {4}}}),
      Catch::Contains("unexpected tensor `mask`"));
  std::filesystem::remove(d + "/cat_qie_te.safetensors");
  CHECK_THAT(ErrorMessageOf([&] { QwenImageDataset(d, cfg, true); }),
             Catch::Contains(latents + ": no text-encoder file cat_qie_te.safetensors") &&
                 Catch::Contains("--model_version edit"));
}

TEST_CASE(
    "qwen_image edit: Edit-2511 (per-token modulation) is refused: ComfyUI's file by its "
    "__index_timestep_zero__ marker, diffusers' config by zero_cond_t",
    "[worker][qwen_image]") {
  TempDir dir("qwen-image-2511");
  FileTensors t = ReadAll(kFixtures + "qi_l2_model.safetensors");
  t.names.push_back("__index_timestep_zero__");
  t.shapes.push_back({0});
  t.bytes.emplace_back();
  WriteAll(dir.str() + "/qwen_image_edit_2511.safetensors", t);
  CHECK_THAT(ErrorMessageOf([&] {
               QwenImageBase::Load(dir.str() + "/qwen_image_edit_2511.safetensors", at::kFloat,
                                   at::kCPU);
             }),
             Catch::Contains("`__index_timestep_zero__`"));
  const QwenImageConfig cfg =
      QwenImageCheckpointReader::Open(kFixtures + "qi_l2_model.safetensors").config();
  std::string json = QwenImageConfigJson(cfg);
  const std::string off = "\"zero_cond_t\": false";
  REQUIRE(json.find(off) != std::string::npos);
  json.replace(json.find(off), off.size(), "\"zero_cond_t\": true");
  CHECK_THAT(ErrorMessageOf([&] { QwenImageConfigFromJson(json, "config.json"); }),
             Catch::Contains("`zero_cond_t` is true"));
}

namespace {

// A random batch of `b` latents on a grid_h x grid_w grid with `lt` caption tokens, a padded
// (masked) caption when `masked`, and one control image of a 2 x 3 grid when `control`.
QwenImageBatch RandomBatch(const QwenImageConfig& cfg, int64_t b, int64_t grid_h, int64_t grid_w,
                           int64_t lt, bool masked, bool control, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  QwenImageBatch x;
  x.grid_h = grid_h;
  x.grid_w = grid_w;
  x.img = at::empty({b, grid_h * grid_w, cfg.in_channels}).normal_(0, 1, g);
  x.txt = at::empty({b, lt, cfg.joint_attention_dim}).normal_(0, 1, g);
  x.timesteps = at::empty({b}).uniform_(0, 1, g);
  if (masked) {
    x.txt_mask = at::ones({b, lt}, at::kBool);
    x.txt_mask[b - 1].narrow(0, lt - 3, 3).fill_(false);  // the last caption 3 tokens shorter
  }
  if (control) {
    x.control_grids = {{2, 3}};
    x.control = at::empty({b, 6, cfg.in_channels}).normal_(0, 1, g);
  }
  return x;
}

}  // namespace

TEST_CASE(
    "qwen_image group stacked: jobs of one shape run as one batch, each job's output and LoRA "
    "gradients its own alone within 1e-5; jobs of other shapes or scales run alone, bit for bit",
    "[worker][qwen_image][group]") {
  using lorastream::testing::GroupStep;
  const QwenImageBase base =
      QwenImageBase::Load(kFixtures + "qi_l3m_model.safetensors", at::kFloat, at::kCPU);
  const QwenImageConfig& cfg = base.config();
  const int units = static_cast<int>(cfg.num_layers);
  // One step of `batches` with `adapters` as a group, `swap` blocks streamed through one slot.
  auto group = [&](const std::vector<QwenImageBatch>& batches,
                   std::vector<QwenImageAdapter>& adapters, bool checkpointed, int swap) {
    auto engine = base.MakeEngine(swap, 1, at::kCPU);
    QwenImageModel model(cfg, base.rest(), engine.get(), at::kCPU, at::kFloat);
    model.SetStackJobs(true);
    return GroupStep(model, batches, adapters, checkpointed);
  };
  auto alone = [&](const QwenImageBatch& batch, const QwenImageAdapter& adapter,
                   bool checkpointed) {
    std::vector<QwenImageAdapter> one{adapter};
    return group({batch}, one, checkpointed, 0);
  };
  // Three jobs of two latents each: a masked caption, none, a masked one; each its own
  // adapter (seed) on every linear; text-to-image, then edit batches with a control image.
  const bool control = GENERATE(false, true);
  INFO((control ? "edit batches (a control image each)" : "text-to-image batches"));
  const std::vector<QwenImageBatch> batches = {RandomBatch(cfg, 2, 3, 5, 7, true, control, 21),
                                               RandomBatch(cfg, 2, 3, 5, 7, false, control, 22),
                                               RandomBatch(cfg, 2, 3, 5, 7, true, control, 23)};
  std::vector<QwenImageAdapter> adapters;
  for (uint64_t seed : {31, 32, 33}) adapters.push_back(RandomAdapter(cfg, "all", seed));
  lorastream::testing::CheckStackedLikeAlone(group, alone, batches, adapters, units);
  // Another grid of as many tokens, or another LoRA scale: no stacking, each job's bits alone.
  std::vector<QwenImageBatch> mixed = batches;
  mixed[1] = RandomBatch(cfg, 2, 5, 3, 7, false, control, 22);
  lorastream::testing::CheckUnstackedLikeAlone(group(mixed, adapters, true, 0), alone, mixed,
                                               adapters);
  std::vector<QwenImageAdapter> other_scale = adapters;
  other_scale[2] = QwenImageAdapter(cfg, QwenImageTargets({"all"}, "test"), 4, 4.0, 33, at::kCPU);
  CHECK_FALSE(group(batches, other_scale, true, 0).stacked);
}
