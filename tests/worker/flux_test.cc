// FLUX.1 on the CPU: the checkpointed units give plain autograd's loss and gradients, those
// gradients match finite differences, a streamed run (every ring, one or two single blocks
// per unit, poisoned and delayed copies) equals the resident run bit for bit, the trainer
// runs end to end from sd-scripts-style caches (reproducibly, streamed = resident over
// several optimizer steps), and the adapter files carry kohya's and diffusers' names.
#include "tests/worker/torch_catch.h"

#include <c10/core/GradMode.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/safetensors.h"
#include "common/job/flux_job.h"
#include "common/posix/subprocess.h"
#include "store/attach.h"
#include "store/server.h"
#include "store/synth.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "tests/worker/dit_taped_steps.h"
#include "tests/worker/worker_test_util.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_model.h"
#include "worker/flux/flux_objective.h"
#include "worker/flux/flux_train.h"
#include "worker/train/adamw.h"

using namespace lorastream;
using lorastream::testing::ErrorMessageOf;
using lorastream::testing::MakeFluxCheckpoint;
using lorastream::testing::TempDir;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;

namespace {

// DIR/model (flux-tiny), DIR/cache (images "cat" and "wide" of two buckets, and "dog" beside
// "cat" when with_dog) and DIR/job.toml: a [flux] section naming them with output_dir "out",
// then `keys`. Returns the job file.
std::string WriteTinyFluxJob(const std::string& dir, bool with_dog, const std::string& keys) {
  MakeFluxCheckpoint(dir + "/model");
  std::filesystem::create_directories(dir + "/cache");
  const FluxCacheShape shape = lorastream::testing::TinyCacheShape();
  lorastream::testing::WriteFluxCache(dir + "/cache", "cat", 32, 32, shape, 1);
  if (with_dog) lorastream::testing::WriteFluxCache(dir + "/cache", "dog", 32, 32, shape, 2);
  lorastream::testing::WriteFluxCache(dir + "/cache", "wide", 48, 32, shape, 3, true);
  const std::string job_path = dir + "/job.toml";
  std::ofstream out(job_path);
  out << "[flux]\ncheckpoint = \"model/flux1.safetensors\"\ncache_dir = \"cache\"\n"
         "output_dir = \"out\"\n"
      << keys;
  return job_path;
}

// A batch of two 32x48-pixel images (latents 4 x 6) with 8 text tokens.
FluxBatch TinyBatch(const FluxConfig& c, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  FluxBatch b;
  const int64_t n = 2, h = 4, w = 6, lt = 8;
  b.img = PackLatents(at::empty({n, 16, h, w}).normal_(0, 1, gen));
  b.img_ids = ImageIds(n, h, w, at::kCPU);
  b.txt = at::empty({n, lt, c.context_in_dim}).normal_(0, 1, gen);
  b.txt_ids = at::zeros({n, lt, 3});
  b.y = at::empty({n, c.vec_in_dim}).normal_(0, 1, gen);
  b.timesteps = at::tensor({0.3f, 0.8f});
  b.guidance = at::full({n}, 1.0f);
  return b;
}

// An adapter on every linear layer with B random too (B = 0 would give A no gradient).
FluxAdapter RandomAdapter(const FluxConfig& c, uint64_t seed) {
  FluxAdapter a(c, FluxTargets({"all"}, "test"), 4, 8.0, seed, at::kCPU);
  at::Generator gen = at::detail::createCPUGenerator(seed + 1);
  c10::NoGradGuard no_grad;
  for (auto& [name, m] : a.modules()) m.b.normal_(0, 0.05, gen);
  return a;
}

struct LossAndGrads {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
};

LossAndGrads Run(FluxModel& model, const FluxBatch& batch, FluxAdapter& adapter, bool ckpt,
                 const at::Tensor& target) {
  for (auto& p : adapter.Params())
    if (p.grad().defined()) p.mutable_grad().zero_();
  model.provider().BeginStep();
  LossAndGrads r;
  r.loss = FlowLoss(model.Forward(batch, adapter, ckpt), target);
  r.loss.backward();
  StepStats stats;
  model.provider().EndStep(stats);
  for (auto& p : adapter.Params()) r.grads.push_back(p.grad().clone());
  return r;
}

// flux-tiny in `dtype`, every unit resident (two single blocks per unit), with a random
// adapter, a batch and a target in that dtype.
struct TinySetup {
  explicit TinySetup(at::ScalarType dtype)
      : dir("flux-model"),
        base(FluxBase::Load(MakeFluxCheckpoint(dir.str()), 2, dtype, at::kCPU)),
        engine(base.MakeEngine(0, 1, at::kCPU)),
        model(base.config(), base.rest(), engine.get(), 2, at::kCPU, dtype),
        adapter(RandomAdapter(base.config(), 11)),
        batch(TinyBatch(base.config(), 5)) {
    for (auto& [name, m] : adapter.modules()) {  // master weights in `dtype` too
      m.a = m.a.detach().to(dtype).requires_grad_(true);
      m.b = m.b.detach().to(dtype).requires_grad_(true);
    }
    batch.img = batch.img.to(dtype);
    batch.txt = batch.txt.to(dtype);
    batch.y = batch.y.to(dtype);
    target = at::randn(batch.img.sizes(), at::detail::createCPUGenerator(9)).to(dtype);
  }
  TempDir dir;
  FluxBase base;
  std::unique_ptr<StreamEngine> engine;
  FluxModel model;
  FluxAdapter adapter;
  FluxBatch batch;
  at::Tensor target;
};

}  // namespace

TEST_CASE("flux: a unit's host buffer holds every page its bytes touch", "[worker][flux]") {
  const int64_t page = static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  for (int64_t n : {int64_t{1}, page - 1, page, page + 1, (int64_t{1} << 20) + 1,
                    3 * (int64_t{1} << 20) + 17}) {
    INFO(n << " bytes");
    const at::Tensor t = PageAlignedHostBytes(static_cast<uint64_t>(n));
    CHECK(t.numel() == n);
    CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % page == 0);
    CHECK(t.count_nonzero().item<int64_t>() == 0);
    // The CUDA backend registers [start, start + n rounded up to a page): all of it is this
    // buffer's own allocation.
    const int64_t pages = (n + page - 1) / page;
    CHECK(static_cast<int64_t>(t.storage().nbytes()) >= t.storage_offset() + pages * page);
  }
}

TEST_CASE("flux: checkpointed units give plain autograd's loss and gradients", "[worker][flux]") {
  TinySetup t(at::kFloat);
  FluxModel& model = t.model;
  FluxAdapter& adapter = t.adapter;
  const FluxBatch& batch = t.batch;
  const at::Tensor& target = t.target;

  const LossAndGrads plain = Run(model, batch, adapter, false, target);
  const LossAndGrads ckpt = Run(model, batch, adapter, true, target);
  CHECK(plain.loss.item<double>() == ckpt.loss.item<double>());
  double max_rel = 0;
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    REQUIRE(plain.grads[i].abs().sum().item<double>() > 0);  // every A and B gets a gradient
    const double rel =
        ((plain.grads[i] - ckpt.grads[i]).abs().max() / plain.grads[i].abs().max()).item<double>();
    max_rel = std::max(max_rel, rel);
  }
  CHECK(max_rel < 1e-5);
}

TEST_CASE(
    "flux: taped units equal checkpointed ones bit for bit (alone and in a group of two, "
    "resident and beside streamed units, over AdamW steps)",
    "[worker][flux]") {
  TempDir dir("flux-taped");
  const FluxBase base = FluxBase::Load(MakeFluxCheckpoint(dir.str()), 2, at::kFloat, at::kCPU);
  const FluxConfig& c = base.config();
  const FluxBatch batches[2] = {TinyBatch(c, 5), TinyBatch(c, 6)};
  const at::Tensor targets[2] = {
      at::randn(batches[0].img.sizes(), at::detail::createCPUGenerator(9)),
      at::randn(batches[1].img.sizes(), at::detail::createCPUGenerator(10))};
  const int units = static_cast<int>(FluxUnits(c, 2).size());
  REQUIRE(units >= 4);
  // `jobs` jobs trained together for three AdamW steps, `swap` units streamed through one
  // slot, the last `taped` resident units taped.
  auto train = [&](int jobs, int swap, int taped) {
    const ResidencyPlan plan = lorastream::testing::TapedPlan(units, swap, taped);
    auto engine = base.MakeEngine(plan, at::kCPU, lorastream::testing::TapedEngineOptions(plan));
    FluxModel model(c, base.rest(), engine.get(), 2, at::kCPU, at::kFloat);
    model.SetTapedUnits(TapedBlocks(plan));
    std::vector<FluxAdapter> adapters;
    for (int j = 0; j < jobs; ++j) adapters.push_back(RandomAdapter(c, 11 + j));
    const lorastream::testing::GroupJobs<FluxBatch, FluxAdapter> group(jobs, batches, adapters);
    return lorastream::testing::TrainSteps(*engine, group.params, 3, [&] {
      const std::vector<at::Tensor> preds =
          model.ForwardGroup(group.batches, group.adapters, /*checkpointed=*/true);
      // The taped units ran under plain autograd (at most the resident ones).
      lorastream::testing::CheckTapedGraph(preds[0], units, std::min(taped, units - swap));
      std::vector<at::Tensor> losses;
      for (int j = 0; j < jobs; ++j) losses.push_back(FlowLoss(preds[j], targets[j]));
      return losses;
    });
  };
  for (int jobs : {1, 2}) {
    for (int swap : {0, 2}) {
      const auto want = train(jobs, swap, 0);
      for (int taped : {1, 3, units - swap}) {
        INFO(jobs << " job(s), " << swap << " units streamed, " << taped << " taped");
        lorastream::testing::CheckSameSteps(train(jobs, swap, taped), want);
      }
    }
  }
}

TEST_CASE("flux: AdamW on the LoRA weights lowers the loss of a fixed batch", "[worker][flux]") {
  TinySetup t(at::kFloat);
  AdamW optimizer(t.adapter.Params(), AdamWOptions{});
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    const LossAndGrads r = Run(t.model, t.batch, t.adapter, true, t.target);
    (step == 0 ? first : last) = r.loss.item<double>();
    optimizer.Step(1e-2);
    optimizer.ZeroGrad();
  }
  INFO("loss " << first << " -> " << last);
  CHECK(last < 0.8 * first);
}

TEST_CASE("flux: LoRA gradients match finite differences (f64)", "[worker][flux]") {
  TinySetup t(at::kDouble);  // f64 master weights too: exact perturbations
  FluxModel& model = t.model;
  FluxAdapter& adapter = t.adapter;
  const FluxBatch& batch = t.batch;
  const at::Tensor& target = t.target;
  const LossAndGrads g = Run(model, batch, adapter, true, target);

  // The directional derivative along a random direction of every LoRA weight, and along
  // one module's B alone (a wrong gradient of one module would hide in the sum).
  for (const std::string only : {"", "single_blocks.3.linear2", "double_blocks.0.txt_mod.lin"}) {
    at::Generator gen = at::detail::createCPUGenerator(21);
    auto params = adapter.Params();
    std::vector<at::Tensor> dirs;
    double analytic = 0;
    size_t k = 0;
    for (const auto& [name, m] : adapter.modules()) {
      for (int ab = 0; ab < 2; ++ab, ++k) {
        at::Tensor d = at::empty(params[k].sizes(), at::kDouble).normal_(0, 1, gen);
        if (!only.empty() && (name != only || ab == 0)) d.zero_();
        analytic += (d * g.grads[k]).sum().item<double>();
        dirs.push_back(d);
      }
    }
    auto loss_at = [&](double eps) {
      c10::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].add_(dirs[i] * eps);
      model.provider().BeginStep();
      const double l = FlowLoss(model.Forward(batch, adapter, false), target).item<double>();
      StepStats s;
      model.provider().EndStep(s);
      for (size_t i = 0; i < params.size(); ++i) params[i].sub_(dirs[i] * eps);
      return l;
    };
    const double eps = 1e-5;
    const double numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
    INFO("direction " << (only.empty() ? "all" : only) << ": analytic " << analytic << ", numeric "
                      << numeric);
    CHECK(std::abs(analytic) > 1e-6);
    CHECK(std::abs(numeric - analytic) < 1e-6 * std::abs(analytic) + 1e-10);
  }
}

TEST_CASE(
    "flux: streamed units equal the resident run bit for bit (rings, unit packing, "
    "poisoned and delayed copies)",
    "[worker][flux]") {
  TempDir dir("flux-stream");
  const std::string path = MakeFluxCheckpoint(dir.str());
  for (int64_t singles : {1, 2}) {
    const FluxBase base = FluxBase::Load(path, singles, at::kFloat, at::kCPU);
    const FluxConfig& c = base.config();
    const FluxBatch batch = TinyBatch(c, 5);
    const at::Tensor target = at::randn(batch.img.sizes(), at::detail::createCPUGenerator(9));
    const int units = static_cast<int>(base.layouts().size());
    auto resident_engine = base.MakeEngine(0, 1, at::kCPU);
    FluxModel resident(c, base.rest(), resident_engine.get(), singles, at::kCPU, at::kFloat);
    FluxAdapter adapter = RandomAdapter(c, 11);
    const LossAndGrads want = Run(resident, batch, adapter, true, target);
    for (int swap : {units, units - 1}) {
      for (int ring : {1, 2}) {
        StreamEngineOptions o;
        o.debug_poison = true;
        o.debug_copy_delay_us = 200;
        o.log_plan = false;
        auto engine = base.MakeEngine(swap, ring, at::kCPU, o);
        FluxModel streamed(c, base.rest(), engine.get(), singles, at::kCPU, at::kFloat);
        for (int step = 0; step < 2; ++step) {
          INFO("singles per unit " << singles << ", " << swap << " of " << units
                                   << " streamed, ring " << ring << ", step " << step);
          const LossAndGrads got = Run(streamed, batch, adapter, true, target);
          CHECK(at::equal(got.loss, want.loss));
          for (size_t i = 0; i < want.grads.size(); ++i)
            REQUIRE(at::equal(got.grads[i], want.grads[i]));
        }
      }
    }
  }
}

TEST_CASE("flux: timestep sampling follows sd-scripts' formulas", "[worker][flux]") {
  at::Generator g1 = at::detail::createCPUGenerator(4), g2 = at::detail::createCPUGenerator(4);
  const at::Tensor sig = SampleTimesteps({"sigmoid", 1.0, 3.0}, 1000, 64, 64, g1);
  const at::Tensor sh = SampleTimesteps({"shift", 1.0, 3.0}, 1000, 64, 64, g2);
  CHECK(at::allclose(sh, sig * 3 / (1 + 2 * sig)));
  CHECK(sig.min().item<float>() > 0);
  CHECK(sig.max().item<float>() < 1);
  CHECK(FluxShiftMu(256) == Approx(0.5));
  CHECK(FluxShiftMu(4096) == Approx(1.15));
  at::Generator g3 = at::detail::createCPUGenerator(4);
  const at::Tensor fs = SampleTimesteps({"flux_shift", 1.0, 3.0}, 1000, 128, 128, g3);
  const double e = std::exp(1.15);
  CHECK(at::allclose(fs, e / (e + (1 / sig - 1))));
  const at::Tensor x = at::ones({2, 3}), noise = at::zeros({2, 3});
  const FlowMatch fm = MakeFlowMatch(x, noise, at::tensor({0.25f, 1.0f}));
  CHECK(fm.noisy[0][0].item<float>() == 0.75f);
  CHECK(fm.noisy[1][0].item<float>() == 0.0f);
  CHECK(fm.target[0][0].item<float>() == -1.0f);
  CHECK(at::equal(UnpackLatents(PackLatents(at::arange(2 * 16 * 4 * 6).view({2, 16, 4, 6})), 4, 6),
                  at::arange(2 * 16 * 4 * 6).view({2, 16, 4, 6})));
}

TEST_CASE(
    "flux trainer: from caches of two buckets to kohya and diffusers adapters; "
    "reproducible, streamed = resident",
    "[worker][flux]") {
  TempDir dir("flux-train");
  const std::string job_path = WriteTinyFluxJob(dir.str(), /*with_dog=*/true,
                                                "steps = 4\nbatch_size = 2\nseed = 7\nrank = 4\n"
                                                "alpha = 8\nlearning_rate = 1e-3\n"
                                                "timestep_sampling = \"flux_shift\"\n");
  const std::string ckpt = dir.str() + "/model/flux1.safetensors";
  REQUIRE(IsFluxJobFile(job_path));
  FluxJob job = LoadFluxJob(job_path);
  CHECK(job.checkpoint == ckpt);
  const FluxTrainResult a = TrainFlux(job, {});
  REQUIRE(a.steps.size() == 4);
  for (const auto& s : a.steps) CHECK(std::isfinite(s.loss));
  CHECK(a.steps[0].tokens != a.steps[1].tokens);  // both buckets were drawn in one epoch

  FluxTrainOptions fresh;
  fresh.resume = false;  // out/ holds the first run's final checkpoint
  const FluxTrainResult again = TrainFlux(job, fresh);
  job.blocks_to_swap = 3;
  job.ring_size = 1;
  job.output_dir = dir.str() + "/out-streamed";
  const FluxTrainResult streamed = TrainFlux(job, {});
  // stream.taped_blocks: the last two resident units taped, beside two streamed.
  job.blocks_to_swap = 2;
  job.taped_blocks = 2;
  job.output_dir = dir.str() + "/out-taped";
  const FluxTrainResult taped = TrainFlux(job, {});
  job.blocks_to_swap = 3;
  job.taped_blocks = 0;
  // A budget of 2.5 MiB: the planner streams units (flux-tiny's step at rank 4 takes about
  // 3.1 MiB with every unit resident); the plan command prints its table.
  job.output_dir = dir.str() + "/out-budget";
  job.gpu_memory_budget = uint64_t{2560} << 10;
  const FluxTrainResult budgeted = TrainFlux(job, {});
  for (size_t i = 0; i < a.steps.size(); ++i) {
    CHECK(again.steps[i].loss == a.steps[i].loss);
    CHECK(streamed.steps[i].loss == a.steps[i].loss);
    CHECK(streamed.steps[i].copies > 0);
    CHECK(taped.steps[i].loss == a.steps[i].loss);
    CHECK(taped.steps[i].copies > 0);
    CHECK(budgeted.steps[i].loss == a.steps[i].loss);
    CHECK(budgeted.steps[i].copies > 0);
  }
  {
    std::ofstream(job_path, std::ios::app) << "gpu_memory_budget = \"2560KiB\"\n";
    int code = -1;
    const std::string table = RunAndCapture({std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker",
                                             "plan", job_path, "--device", "cpu"},
                                            &code, 120, dir.str() + "/plan.log");
    CHECK(code == 0);
    CHECK_THAT(table, Catch::Matchers::Contains("budget 2.5 MiB"));
    CHECK_THAT(table, Catch::Matchers::Contains("chosen: swap "));
    CHECK_THAT(table, Catch::Matchers::Contains("PCIe floor"));
  }

  const auto kohya = SafetensorsFile::Open(a.kohya_path);
  const auto* up = kohya.Find("lora_unet_double_blocks_1_txt_attn_qkv.lora_up.weight");
  REQUIRE(up != nullptr);
  CHECK(up->shape == std::vector<int64_t>{192, 4});
  REQUIRE(kohya.Find("lora_unet_single_blocks_3_modulation_lin.alpha") != nullptr);
  CHECK(kohya.tensors().size() == 3u * (10 * 2 + 3 * 4));
  const auto diff = SafetensorsFile::Open(a.diffusers_path);
  const auto* q = diff.Find("transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight");
  REQUIRE(q != nullptr);
  CHECK(q->shape == std::vector<int64_t>{64, 4});
  CHECK(diff.Find("transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight") != nullptr);

  // The kohya file loads back into an adapter bit for bit; the streamed run's is identical.
  const FluxBase base = FluxBase::Load(ckpt, 2, at::kFloat, at::kCPU);
  FluxAdapter back(base.config(), FluxTargets({"all"}, "t"), 4, 8.0, 0, at::kCPU);
  LoadKohyaAdapter(a.kohya_path, back);
  FluxAdapter back2(base.config(), FluxTargets({"all"}, "t"), 4, 8.0, 1, at::kCPU);
  LoadKohyaAdapter(streamed.kohya_path, back2);
  for (size_t i = 0; i < back.Params().size(); ++i)
    CHECK(at::equal(back.Params()[i], back2.Params()[i]));
  // diffusers' B is the kohya B times alpha / r, split by rows.
  const auto& m = back.modules().at("single_blocks.0.linear1");
  const at::Tensor b = at::from_blob(const_cast<uint8_t*>(diff.Data(*q)), {64, 4}, at::kFloat);
  CHECK(at::allclose(b, m.b.narrow(0, 0, 64) * 2.0));
}

TEST_CASE(
    "flux trainer: a stopped run and a killed one resume to the uninterrupted run's adapters "
    "bit for bit",
    "[worker][flux]") {
  TempDir dir("flux-resume");
  const std::string job_path = WriteTinyFluxJob(
      dir.str(), /*with_dog=*/false,
      "steps = 6\nsave_every = 2\nseed = 5\nrank = 4\nlearning_rate = 1e-3\n"
      "lr_schedule = \"cosine\"\nwarmup_steps = 2\nblocks_to_swap = 3\nring_size = 1\n");
  FluxJob job = LoadFluxJob(job_path);
  job.output_dir = dir.str() + "/full";
  const FluxTrainResult full = TrainFlux(job, {});
  REQUIRE(full.steps.size() == 6);

  // Stopped after step 3 (what SIGTERM asks for): checkpoint-3 is saved, no final adapter.
  auto run_until_stop = [&](const std::string& out) {
    job.output_dir = out;
    std::atomic<int> stop{0};
    FluxTrainOptions o;
    o.stop = &stop;
    o.on_step = [&](const StepStats& s) {
      if (s.step == 3) stop = 1;
    };
    const FluxTrainResult r = TrainFlux(job, o);
    CHECK(r.steps.size() == 3);
    CHECK(r.kohya_path.empty());
    CHECK(std::filesystem::is_directory(out + "/checkpoint-2"));
    CHECK(std::filesystem::is_directory(out + "/checkpoint-3"));
  };
  auto resume_and_compare = [&](int64_t from_step) {
    const FluxTrainResult r = TrainFlux(job, {});
    CHECK(r.first_step == from_step);
    REQUIRE(r.steps.size() == static_cast<size_t>(6 - from_step));
    for (size_t i = 0; i < r.steps.size(); ++i)
      CHECK(r.steps[i].loss == full.steps[from_step + i].loss);
    CHECK(lorastream::testing::ReadFile(r.kohya_path) ==
          lorastream::testing::ReadFile(full.kohya_path));
    CHECK(lorastream::testing::ReadFile(r.diffusers_path) ==
          lorastream::testing::ReadFile(full.diffusers_path));
    CHECK(
        lorastream::testing::ReadFile(job.output_dir + "/checkpoint-6/trainer_state.safetensors") ==
        lorastream::testing::ReadFile(dir.str() + "/full/checkpoint-6/trainer_state.safetensors"));
  };
  run_until_stop(dir.str() + "/stopped");
  resume_and_compare(3);
  // A finished job asked again trains nothing.
  const FluxTrainResult again = TrainFlux(job, {});
  CHECK(again.steps.empty());
  CHECK(again.first_step == 6);

  // Killed while saving checkpoint-3: the unfinished temporary is removed, step 2 resumes.
  run_until_stop(dir.str() + "/killed");
  std::filesystem::rename(dir.str() + "/killed/checkpoint-3",
                          dir.str() + "/killed/.checkpoint-3.tmp");
  resume_and_compare(2);

  // A damaged newest checkpoint is not used; another rank is refused, naming the settings.
  run_until_stop(dir.str() + "/damaged");
  {
    std::fstream f(dir.str() + "/damaged/checkpoint-3/adapter_kohya.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  job.rank = 8;
  CHECK_THAT(ErrorMessageOf([&] { TrainFlux(job, {}); }),
             Catch::Matchers::Contains("other settings"));
  job.rank = 4;
  resume_and_compare(2);
}

TEST_CASE(
    "flux: a diffusers folder (sharded, FluxTransformer2DModel's names) loads the BFL file's "
    "weights; other layouts are refused by name",
    "[worker][flux]") {
  TempDir dir("flux-diffusers");
  const std::string bfl = MakeFluxCheckpoint(dir.str() + "/bfl");
  store::SynthOptions o;
  o.preset = "flux-tiny";
  o.out_dir = dir.str() + "/diffusers";
  o.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  o.seed = 3;
  o.dtype = "f32";
  o.flux_format = "diffusers";
  o.shard_bytes = 400000;
  CHECK(store::RunSynth(o).shards > 1);
  CHECK(DetectFluxCheckpoint(o.out_dir) == FluxCheckpointKind::kDiffusersFolder);
  const FluxBase a = FluxBase::Load(bfl, 2, at::kFloat, at::kCPU);
  const FluxBase b = FluxBase::Load(o.out_dir, 2, at::kFloat, at::kCPU);
  CHECK(b.config().depth == a.config().depth);
  CHECK(b.config().axes_dim == a.config().axes_dim);
  REQUIRE(a.unit_bytes().size() == b.unit_bytes().size());
  for (size_t u = 0; u < a.unit_bytes().size(); ++u)
    CHECK(std::memcmp(a.unit_bytes()[u], b.unit_bytes()[u], a.layouts()[u].nbytes) == 0);
  for (const auto& [name, t] : a.rest()) CHECK(at::equal(t, b.rest().at(name)));
  // The transformer folder itself is read too.
  CHECK(FluxBase::Load(o.out_dir + "/transformer", 1, at::kFloat, at::kCPU).config().depth == 2);

  // A missing tensor is named; a folder that is neither layout is refused by name.
  const std::string index =
      o.out_dir + "/transformer/diffusion_pytorch_model.safetensors.index.json";
  std::string text;
  {
    std::ifstream in(index);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string key = "\"transformer_blocks.1.attn.add_k_proj.bias\"";
  const size_t at_key = text.find(key);
  REQUIRE(at_key != std::string::npos);
  const size_t line_end = text.find('\n', at_key);
  text.erase(at_key, line_end - at_key);
  std::ofstream(index) << text;  // (the shard still holds it: the index is cross-checked)
  CHECK_THAT(ErrorMessageOf([&] { FluxBase::Load(o.out_dir, 2, at::kFloat, at::kCPU); }),
             Catch::Matchers::Contains("transformer_blocks.1.attn.add_k_proj.bias"));
  std::filesystem::create_directories(dir.str() + "/empty");
  CHECK_THAT(ErrorMessageOf([&] { FluxBase::Load(dir.str() + "/empty", 2, at::kFloat, at::kCPU); }),
             Catch::Matchers::Contains("FluxTransformer2DModel"));
}

TEST_CASE(
    "lorastream-worker train on a FLUX job: SIGTERM checkpoints and exits 143, SIGKILL loses "
    "only the steps after the last checkpoint; the resumed adapter is the uninterrupted one",
    "[worker][flux]") {
  TempDir dir("flux-signal");
  const std::string job_path =
      WriteTinyFluxJob(dir.str(), /*with_dog=*/false,
                       "steps = 100000\nsave_every = 3\nseed = 9\nrank = 4\n"
                       "learning_rate = 1e-3\nblocks_to_swap = 2\n");
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  const std::string out = dir.str() + "/out";
  auto newest = [&] {
    const auto all = ListCheckpoints(out);
    return all.empty() ? int64_t{0} : all.front().step;
  };
  SpawnOptions so;
  so.log_path = dir.str() + "/log";
  {
    Subprocess p =
        Subprocess::Spawn({bin, "train", job_path, "--device", "cpu", "--threads", "1"}, so);
    REQUIRE(lorastream::testing::WaitFor([&] { return newest() >= 3 || !p.Running(); }, 120));
    p.Signal(SIGTERM);
    CHECK(p.Wait(120) == 143);
  }
  INFO(lorastream::testing::ReadFile(dir.str() + "/log"));
  const int64_t stopped_at = newest();
  CHECK(stopped_at >= 3);
  {
    Subprocess p =
        Subprocess::Spawn({bin, "train", job_path, "--device", "cpu", "--threads", "1"}, so);
    REQUIRE(lorastream::testing::WaitFor([&] { return newest() >= stopped_at + 3 || !p.Running(); },
                                         120));
    p.Signal(SIGKILL);
    CHECK(p.Wait(120) == 128 + SIGKILL);
  }
  CHECK_THAT(lorastream::testing::ReadFile(dir.str() + "/log"),
             Catch::Matchers::Contains("resuming from"));

  // The rest in this process, to two steps past the newest checkpoint, against the same
  // steps uninterrupted (constant learning rate: the step count changes no step).
  FluxJob job = LoadFluxJob(job_path);
  job.steps = newest() + 2;
  FluxTrainOptions one;
  one.threads = 1;
  const FluxTrainResult resumed = TrainFlux(job, one);
  CHECK(resumed.first_step == job.steps - 2);
  job.output_dir = dir.str() + "/uninterrupted";
  const FluxTrainResult full = TrainFlux(job, one);
  CHECK(full.first_step == 0);
  CHECK(lorastream::testing::ReadFile(resumed.kohya_path) ==
        lorastream::testing::ReadFile(full.kohya_path));
  CHECK(lorastream::testing::ReadFile(resumed.diffusers_path) ==
        lorastream::testing::ReadFile(full.diffusers_path));
}

TEST_CASE("flux units are served by name; an LLM layout with their names is still refused",
          "[worker][flux]") {
  const at::Tensor bytes = at::zeros({1024}, at::kByte);
  const SegmentInfo seg = LayoutSegment(
      {{"single_blocks.0.linear1.weight", {4, 8}}, {"single_blocks.0.linear1.bias", {4}}}, "unit",
      DType::kF32, 256);
  const BlockWeights w = BlockWeightsFromBytes(bytes, seg, BlockNaming::kByName);
  REQUIRE(w.named.size() == 2);
  CHECK(w.named.at("single_blocks.0.linear1.weight").sizes() == at::IntArrayRef({4, 8}));
  CHECK(!w.input_norm.defined());
  CHECK_THAT(ErrorMessageOf([&] { BlockWeightsFromBytes(bytes, seg); }),
             Catch::Matchers::Contains("unexpected tensor `single_blocks.0.linear1.weight`"));
  Manifest m;
  CHECK(BlockNamingOf(m) == BlockNaming::kLlmFields);
  m.config.model_type = kFluxModelType;
  CHECK(BlockNamingOf(m) == BlockNaming::kByName);
}

TEST_CASE("flux jobs: bad keys and bad caches are refused naming the key or the file",
          "[worker][flux]") {
  TempDir dir("flux-job");
  const std::string job_path = dir.str() + "/job.toml";
  auto write = [&](const std::string& extra) {
    std::ofstream out(job_path);
    out << "[flux]\ncheckpoint = \"m/flux1.safetensors\"\ncache_dir = \"cache\"\n"
           "output_dir = \"out\"\n"
        << extra;
  };
  write("timestep_sampling = \"logit_normal\"\n");
  CHECK_THAT(ErrorMessageOf([&] { LoadFluxJob(job_path); }),
             Catch::Contains("flux.timestep_sampling"));
  write("ranke = 4\n");
  CHECK_THAT(ErrorMessageOf([&] { LoadFluxJob(job_path); }), Catch::Contains("ranke"));

  MakeFluxCheckpoint(dir.str() + "/m");
  std::filesystem::create_directories(dir.str() + "/cache");
  FluxCacheShape wrong = lorastream::testing::TinyCacheShape();
  wrong.channels = 4;  // an SD 1.x / SDXL latent in a FLUX folder
  lorastream::testing::WriteFluxCache(dir.str() + "/cache", "sdxl", 32, 32, wrong, 1);
  write("steps = 1\n");
  const std::string e = ErrorMessageOf([&] { TrainFlux(LoadFluxJob(job_path), {}); });
  CHECK_THAT(e, Catch::Contains("sdxl_0032x0032_flux.npz"));
  CHECK_THAT(e, Catch::Contains("expected [16, 4, 4]"));
}

TEST_CASE(
    "a FLUX job on a store trains as on the checkpoint, bit for bit, its units streamed from "
    "the read-only mapping",
    "[worker][flux]") {
  TempDir dir("flux-store-train");
  const std::string job_path = WriteTinyFluxJob(
      dir.str(), /*with_dog=*/true,
      "steps = 3\nbatch_size = 2\nseed = 5\nrank = 4\nlearning_rate = 1e-3\nblocks_to_swap = 3\n"
      "ring_size = 1\n");
  const FluxJob from_checkpoint = LoadFluxJob(job_path);
  store::ServeOptions serve;
  serve.model_dir = from_checkpoint.checkpoint;
  serve.name = "test-flux-train-" + std::to_string(::getpid());
  serve.threads = 2;
  serve.lock = false;
  const auto published = store::PublishedStore::Build(serve);

  // The job file names the store; units and their packing are the store's.
  {
    std::ofstream out(dir.str() + "/store.toml");
    out << "[flux]\nstore = \"" << serve.name
        << "\"\ncache_dir = \"cache\"\noutput_dir = \"out-store\"\nsteps = 3\nbatch_size = 2\n"
           "seed = 5\nrank = 4\nlearning_rate = 1e-3\nblocks_to_swap = 3\nring_size = 1\n";
  }
  const FluxJob from_store = LoadFluxJob(dir.str() + "/store.toml");
  CHECK(from_store.checkpoint.empty());
  CHECK(from_store.store == serve.name);
  const FluxTrainResult a = TrainFlux(from_checkpoint, {});
  const FluxTrainResult b = TrainFlux(from_store, {});
  REQUIRE(a.steps.size() == 3);
  REQUIRE(b.steps.size() == 3);
  for (size_t i = 0; i < a.steps.size(); ++i) {
    CHECK(b.steps[i].loss == a.steps[i].loss);
    CHECK(b.steps[i].copies > 0);
  }
  CHECK(lorastream::testing::ReadFile(b.kohya_path) == lorastream::testing::ReadFile(a.kohya_path));
  CHECK(lorastream::testing::ReadFile(b.diffusers_path) ==
        lorastream::testing::ReadFile(a.diffusers_path));

  // Zero-copy and read-only: the units are the mapping's bytes, and a write faults.
  const FluxBase base = FluxBase::FromStore(serve.name, at::kFloat, at::kCPU);
  const store::AttachedStore attached = store::AttachedStore::Attach(serve.name);
  REQUIRE(base.unit_bytes().size() == static_cast<size_t>(attached.num_blocks()));
  CHECK(std::memcmp(base.unit_bytes()[1], attached.block_data(1), attached.block_size(1)) == 0);
  CHECK(lorastream::testing::WriteFaults(base.unit_bytes()[0]));

  // A store converting a diffusers folder to bf16 (each tensor from its runs of rows) holds the
  // bytes the worker's own bf16 packing of the BFL file holds.
  store::SynthOptions diffusers;
  diffusers.preset = "flux-tiny";
  diffusers.out_dir = dir.str() + "/diffusers";
  diffusers.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  diffusers.seed = 3;
  diffusers.dtype = "f32";
  diffusers.flux_format = "diffusers";
  diffusers.shard_bytes = 400000;
  store::RunSynth(diffusers);
  store::ServeOptions serve_bf16 = serve;
  serve_bf16.model_dir = diffusers.out_dir;
  serve_bf16.name = serve.name + "-bf16";
  serve_bf16.to_bf16 = true;
  const auto published_bf16 = store::PublishedStore::Build(serve_bf16);
  const FluxBase packed = FluxBase::Load(from_checkpoint.checkpoint, 2, at::kBFloat16, at::kCPU);
  const FluxBase served = FluxBase::FromStore(serve_bf16.name, at::kBFloat16, at::kCPU);
  REQUIRE(served.unit_bytes().size() == packed.unit_bytes().size());
  for (size_t u = 0; u < packed.unit_bytes().size(); ++u)
    CHECK(std::memcmp(served.unit_bytes()[u], packed.unit_bytes()[u], packed.layouts()[u].nbytes) ==
          0);
  for (const auto& [name, t] : packed.rest()) CHECK(at::equal(t, served.rest().at(name)));

  // A store of another dtype than the job's, both sources, and a store with singles_per_unit
  // are refused by name.
  FluxJob bf16 = from_store;
  bf16.dtype = "bf16";
  CHECK_THAT(ErrorMessageOf([&] { TrainFlux(bf16, {}); }),
             Catch::Contains("holds F32 weights") && Catch::Contains("flux.dtype = \"f32\""));
  std::ofstream(dir.str() + "/store.toml", std::ios::app) << "singles_per_unit = 1\n";
  CHECK_THAT(ErrorMessageOf([&] { LoadFluxJob(dir.str() + "/store.toml"); }),
             Catch::Contains("flux.singles_per_unit") && Catch::Contains("a store fixes"));
  std::ofstream(job_path, std::ios::app) << "store = \"" << serve.name << "\"\n";
  CHECK_THAT(ErrorMessageOf([&] { LoadFluxJob(job_path); }),
             Catch::Contains("exactly one of flux.checkpoint") && Catch::Contains("flux.store"));
}

TEST_CASE(
    "flux trainer: a standalone job writes stats.jsonl, a step per line, each step once across a "
    "stop and its resume",
    "[worker][flux]") {
  TempDir dir("flux-stats");
  const std::string job_path =
      WriteTinyFluxJob(dir.str(), /*with_dog=*/true, "steps = 4\nseed = 2\nrank = 4\n");
  FluxJob job = LoadFluxJob(job_path);
  auto read_stats = [&] {
    std::ifstream lines(job.output_dir + "/stats.jsonl");
    std::vector<nlohmann::json> out;
    for (std::string line; std::getline(lines, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  };
  // Stopped after step 2, then resumed to the end: steps 1..4, each once, as the run reported.
  std::atomic<int> stop{0};
  FluxTrainOptions o;
  o.stop = &stop;
  o.on_step = [&](const StepStats& s) {
    if (s.step == 2) stop = 1;
  };
  const FluxTrainResult first = TrainFlux(job, o);
  REQUIRE(first.steps.size() == 2);
  CHECK(read_stats().size() == 2);
  const FluxTrainResult rest = TrainFlux(job, {});
  REQUIRE(rest.steps.size() == 2);
  const std::vector<nlohmann::json> stats = read_stats();
  REQUIRE(stats.size() == 4);
  for (size_t i = 0; i < stats.size(); ++i) {
    INFO("line " << i);
    CHECK(stats[i]["step"].get<int64_t>() == static_cast<int64_t>(i + 1));
    CHECK(stats[i]["total_steps"].get<int64_t>() == 4);
    const StepStats& s = i < 2 ? first.steps[i] : rest.steps[i - 2];
    CHECK(stats[i]["loss"].get<double>() == Approx(s.loss).epsilon(1e-12));
    CHECK(stats[i]["tokens"].get<int64_t>() == s.tokens);
    CHECK(s.tokens > 0);
  }
}

TEST_CASE(
    "flux group stacked: jobs of one shape run as one batch, each job's output and LoRA "
    "gradients its own alone within 1e-5; a job of another shape runs alone, bit for bit",
    "[worker][flux][group]") {
  using lorastream::testing::GroupStep;
  TempDir dir("flux-stacked");
  const FluxBase base = FluxBase::Load(MakeFluxCheckpoint(dir.str()), 2, at::kFloat, at::kCPU);
  const FluxConfig& c = base.config();
  const int units = static_cast<int>(FluxUnits(c, 2).size());
  auto group = [&](const std::vector<FluxBatch>& batches, std::vector<FluxAdapter>& adapters,
                   bool checkpointed, int swap) {
    auto engine = base.MakeEngine(swap, 1, at::kCPU);
    FluxModel model(c, base.rest(), engine.get(), 2, at::kCPU, at::kFloat);
    model.SetStackJobs(true);
    return GroupStep(model, batches, adapters, checkpointed);
  };
  auto alone = [&](const FluxBatch& batch, const FluxAdapter& adapter, bool checkpointed) {
    std::vector<FluxAdapter> one{adapter};
    return group({batch}, one, checkpointed, 0);
  };
  std::vector<FluxBatch> batches = {TinyBatch(c, 41), TinyBatch(c, 42), TinyBatch(c, 43)};
  batches[1].timesteps = at::tensor({0.55f, 0.1f});
  std::vector<FluxAdapter> adapters;
  for (uint64_t seed : {51, 52, 53}) adapters.push_back(RandomAdapter(c, seed));
  lorastream::testing::CheckStackedLikeAlone(group, alone, batches, adapters, units);
  // A job of another latent size: no stacking, each job's bits alone.
  FluxBatch small = TinyBatch(c, 44);
  small.img = PackLatents(at::randn({2, 16, 4, 4}, at::detail::createCPUGenerator(45)));
  small.img_ids = ImageIds(2, 4, 4, at::kCPU);
  const std::vector<FluxBatch> mixed = {batches[0], small};
  std::vector<FluxAdapter> two{adapters[0], adapters[1]};
  lorastream::testing::CheckUnstackedLikeAlone(group(mixed, two, true, 0), alone, mixed, two);
}

TEST_CASE(
    "dit: jobs stack on CUDA by default, never on the CPU; LORASTREAM_STACK_JOBS=0 turns it off",
    "[worker][flux][group]") {
  const c10::Device cuda(c10::DeviceType::CUDA, 0);
  ::unsetenv("LORASTREAM_STACK_JOBS");
  CHECK(dit::StackJobsByDefault(cuda));
  CHECK_FALSE(dit::StackJobsByDefault(at::kCPU));
  ::setenv("LORASTREAM_STACK_JOBS", "0", 1);
  CHECK_FALSE(dit::StackJobsByDefault(cuda));
  ::setenv("LORASTREAM_STACK_JOBS", "1", 1);
  CHECK(dit::StackJobsByDefault(cuda));
  ::unsetenv("LORASTREAM_STACK_JOBS");
}
