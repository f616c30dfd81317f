// The training loop: reproducible with a seed, bit-exact resume, refusals at start, the
// optimizer's arithmetic, and a loss that goes down.
#include "torch_catch.h"  // first: see there

#include "worker/train/trainer.h"

#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/safetensors.h"
#include "common/posix/subprocess.h"
#include "worker/train/adamw.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

std::string Adapter(const std::string& dir) {
  return testing::ReadFile(dir + "/adapter_model.safetensors");
}

ErrorCode RefusalOf(const JobSpec& spec, std::string* message,
                    const std::function<void(const StepStats&)>& on_step = {}) {
  try {
    TrainOptions o;
    o.threads = 1;  // 2 cores shared with the rest of CI: more threads only spin
    RunTraining(spec, o, on_step);
  } catch (const Error& e) {
    *message = e.what();
    return e.code();
  }
  return ErrorCode::kOk;
}

// Stops a run at the boundary after step `step`: on_step raises the flag should_stop reads.
// (The trainer asks should_stop before every block too, so counting its calls counts no
// steps.)
struct StopAfter {
  int64_t step;
  bool done = false;
  std::function<void(const StepStats&)> on_step() {
    return [this](const StepStats& s) { done = done || s.step >= step; };
  }
  std::function<bool()> should_stop() {
    return [this] { return done; };
  }
};

}  // namespace

TEST_CASE("training is bit-reproducible with a seed and the loss goes down", "[worker]") {
  testing::TempDir dir("train");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 2, 32, 32, 512);  // two sequences to memorise
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "a");
  spec.train.steps = 25;
  spec.lora.rank = 8;
  spec.lora.dropout = 0.05;
  spec.optim.lr = 3e-2;
  spec.optim.schedule = "constant";
  std::vector<double> losses;
  TrainOptions o;
  o.threads = 1;  // 2 cores shared with the rest of CI: more threads only spin
  TrainResult r = RunTraining(spec, o, [&](const StepStats& s) { losses.push_back(s.loss); });
  CHECK(r.steps_done == 25);
  CHECK(!r.stopped);
  REQUIRE(losses.size() == 25);
  INFO("first loss " << losses.front() << " last " << losses.back());
  // The random base's LM head has small weights (logits within a few units), so even a
  // memorised batch stays far above 0; the loss must still fall steadily.
  CHECK(losses.back() < losses.front() - 0.15);
  CHECK(losses[20] < losses[10]);
  CHECK(losses[10] < losses[0]);

  spec.train.output_dir = dir / "b";
  RunTraining(spec, o);
  CHECK(Adapter(dir / "a") == Adapter(dir / "b"));
  spec.train.seed = 4;
  spec.train.output_dir = dir / "c";
  RunTraining(spec, o);
  CHECK(Adapter(dir / "a") != Adapter(dir / "c"));
}

TEST_CASE("a resumed run ends bit-identical to an uninterrupted one", "[worker]") {
  testing::TempDir dir("resume");
  testing::MakeCheckpoint(dir / "m", "tiny-qwen3");
  testing::WriteJsonl(dir / "d.jsonl", 6, 10, 50, 320);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "full");
  spec.train.steps = 6;
  spec.train.grad_accum = 2;
  spec.train.checkpoint_every = 2;
  spec.lora.dropout = 0.1;
  spec.optim.schedule = "cosine";
  spec.optim.warmup_steps = 1;
  spec.optim.weight_decay = 0.01;
  spec.optim.grad_clip = 0.5;
  TrainOptions o;
  o.threads = 1;  // 2 cores shared with the rest of CI: more threads only spin
  RunTraining(spec, o);

  spec.train.output_dir = dir / "split";
  StopAfter at3{3};
  TrainResult first = RunTraining(spec, o, at3.on_step(), at3.should_stop());
  CHECK(first.stopped);
  CHECK(first.steps_done == 3);
  CHECK(std::filesystem::exists(dir / "split/checkpoint-3/trainer_state.safetensors"));
  CHECK(std::filesystem::exists(dir / "split/checkpoint-2"));  // keep_checkpoints = 2
  TrainResult second = RunTraining(spec, o);
  CHECK(second.start_step == 3);
  CHECK(second.steps_done == 6);
  CHECK(!std::filesystem::exists(dir / "split/checkpoint-3"));  // beyond the newest two
  CHECK(std::filesystem::exists(dir / "split/checkpoint-4"));
  CHECK(Adapter(dir / "full") == Adapter(dir / "split"));
  CHECK(testing::ReadFile(dir / "full/checkpoint-6/trainer_state.safetensors") ==
        testing::ReadFile(dir / "split/checkpoint-6/trainer_state.safetensors"));

  // A resume with other settings is refused rather than silently mixing two jobs.
  spec.lora.alpha = 3;
  spec.train.steps = 8;
  std::string msg;
  CHECK(RefusalOf(spec, &msg) == ErrorCode::kRefused);
  CHECK(msg.find("other settings") != std::string::npos);
}

TEST_CASE("a damaged checkpoint is never resumed: the previous one is, or the resume fails",
          "[worker]") {
  testing::TempDir dir("damaged");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 4, 10, 40, 512);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "full");
  spec.train.steps = 4;
  spec.train.checkpoint_every = 1;
  TrainOptions o;
  o.threads = 1;  // 2 cores shared with the rest of CI: more threads only spin
  RunTraining(spec, o);

  spec.train.output_dir = dir / "split";
  StopAfter at3{3};
  CHECK(RunTraining(spec, o, at3.on_step(), at3.should_stop()).steps_done == 3);
  // One low bit of the newest checkpoint's adapter (the last f32 weight's lowest byte).
  {
    std::fstream f(dir / "split/checkpoint-3/adapter_model.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-4, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-4, std::ios::end);
    f.put(static_cast<char>(c ^ 1));
  }
  TrainResult resumed = RunTraining(spec, o);
  CHECK(resumed.start_step == 2);  // checkpoint-3 is damaged: checkpoint-2 is used
  CHECK(Adapter(dir / "full") == Adapter(dir / "split"));

  // The trainer state gone from the only checkpoint: an error, not a silent fresh start.
  spec.train.output_dir = dir / "gone";
  spec.train.keep_checkpoints = 1;
  StopAfter at2{2};
  RunTraining(spec, o, at2.on_step(), at2.should_stop());
  std::filesystem::remove(dir / "gone/checkpoint-2/trainer_state.safetensors");
  std::string msg;
  CHECK(RefusalOf(spec, &msg) == ErrorCode::kCorrupt);
  CHECK_THAT(msg, Catch::Contains("no usable checkpoint"));
  CHECK_THAT(msg, Catch::Contains("checkpoint-2/trainer_state.safetensors: missing"));
  CHECK(std::filesystem::exists(dir / "gone/checkpoint-2/adapter_model.safetensors"));
  CHECK(!std::filesystem::exists(dir / "gone/adapter_model.safetensors"));
}

TEST_CASE("a direct checkpoint load runs the store's validation: layers, NaN weights", "[worker]") {
  testing::TempDir dir("direct");
  testing::MakeCheckpoint(dir / "m", "tiny");  // 4 layers
  testing::WriteJsonl(dir / "d.jsonl", 2, 10, 20, 512);
  // config.json says 2 layers while the file holds 4: refused, not trained on 2 of them.
  std::string config = testing::ReadFile(dir / "m/config.json");
  const size_t at = config.find("\"num_hidden_layers\": 4");
  REQUIRE(at != std::string::npos);
  config.replace(at, 22, "\"num_hidden_layers\": 2");
  std::ofstream(dir / "m/config.json", std::ios::trunc) << config;
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "o");
  std::string msg;
  CHECK(RefusalOf(spec, &msg) == ErrorCode::kCorrupt);
  CHECK_THAT(msg, Catch::Contains("config.json has num_hidden_layers = 2"));

  // A NaN in a base weight: refused naming the tensor (not blamed on optim.lr after a step).
  testing::MakeCheckpoint(dir / "n", "tiny");
  {
    SafetensorsFile f = SafetensorsFile::Open(dir / "n/model.safetensors");
    const SafetensorsEntry* e = f.Find("model.layers.0.self_attn.q_proj.weight");
    REQUIRE(e != nullptr);
    const uint64_t offset = f.header().data_offset + e->begin + 4 * sizeof(float);
    std::fstream out(dir / "n/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    out.seekp(static_cast<std::streamoff>(offset));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    out.write(reinterpret_cast<const char*>(&nan), sizeof nan);
  }
  spec = testing::TinyJob(dir / "n", dir / "d.jsonl", dir / "o2");
  CHECK(RefusalOf(spec, &msg) == ErrorCode::kCorrupt);
  CHECK_THAT(msg, Catch::Contains("model.layers.0.self_attn.q_proj.weight` holds a NaN"));
}

TEST_CASE("lorastream-worker exits 2 for a bad command line, 3 for a missing job file",
          "[worker]") {
  testing::TempDir dir("exit");
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  int code = -1;
  RunAndCapture({bin, "train", "--no-such-flag", "x.toml"}, &code, 120, dir / "err");
  CHECK(code == 2);
  RunAndCapture({bin}, &code, 120, dir / "err");
  CHECK(code == 2);  // a subcommand is required
  RunAndCapture({bin, "train", dir / "missing.toml"}, &code, 120, dir / "err");
  CHECK(code == 3);
}

TEST_CASE("a statistics file that cannot be written fails the job, naming it", "[worker]") {
  if (!std::filesystem::exists("/dev/full")) return;
  testing::TempDir dir("full");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 2, 10, 20, 512);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "o");
  spec.train.steps = 1;
  spec.train.stats_file = "/dev/full";
  std::string msg;
  CHECK(RefusalOf(spec, &msg) == ErrorCode::kIo);
  CHECK_THAT(msg, Catch::Contains("train.stats_file /dev/full"));
}

TEST_CASE("a diverging run fails at the step whose loss is not finite, keeping what it saved",
          "[worker]") {
  testing::TempDir dir("nan");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 4, 10, 20, 512);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "o");
  spec.train.steps = 4;
  spec.train.checkpoint_every = 1;
  spec.optim.lr = 1e30;  // the first update overflows the adapter's output
  spec.optim.grad_clip = 0;
  spec.optim.schedule = "constant";
  std::vector<double> losses;
  std::string msg;
  CHECK(RefusalOf(spec, &msg, [&](const StepStats& s) { losses.push_back(s.loss); }) ==
        ErrorCode::kInternal);
  INFO(msg);
  REQUIRE(losses.size() == 1);  // step 1's loss was read from the base alone: finite
  CHECK(std::isfinite(losses[0]));
  CHECK_THAT(msg, Catch::Contains("the loss is") && Catch::Contains("at step 2") &&
                      Catch::Contains("optim.lr"));
  // The checkpoint of step 1 is whole; none holds the diverged step.
  CHECK(std::filesystem::exists(dir / "o/checkpoint-1/trainer_state.safetensors"));
  CHECK(!std::filesystem::exists(dir / "o/checkpoint-2"));
  CHECK(!std::filesystem::exists(dir / "o/adapter_model.safetensors"));
}

TEST_CASE("jobs that cannot run are refused at start, naming the field", "[worker]") {
  testing::TempDir dir("refuse");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 2, 10, 20, 512);
  testing::WriteJsonl(dir / "big.jsonl", 3, 10, 20, 600);
  std::string msg;
  JobSpec s = testing::TinyJob(dir / "m", dir / "big.jsonl", dir / "o");
  CHECK(RefusalOf(s, &msg) == ErrorCode::kRefused);
  CHECK(msg.find("big.jsonl:") != std::string::npos);
  CHECK(msg.find("vocab_size is 512") != std::string::npos);

  s = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "o");
  s.data.seq_len = 300;
  CHECK(RefusalOf(s, &msg) == ErrorCode::kRefused);
  CHECK(msg.find("data.seq_len") != std::string::npos);
  s.data.seq_len = 32;
  s.lora.rank = -1;
  CHECK(RefusalOf(s, &msg) == ErrorCode::kRefused);
  CHECK(msg.find("lora.rank") != std::string::npos);
  s.lora.rank = 4;
  s.lora.targets = {"q_proj", "attn"};
  CHECK(RefusalOf(s, &msg) == ErrorCode::kRefused);
  CHECK(msg.find("lora.targets") != std::string::npos);
  s.lora.targets = {"q_proj"};
  s.data.path = dir / "gone.jsonl";
  CHECK(RefusalOf(s, &msg) == ErrorCode::kRefused);
  CHECK(msg.find("data.path") != std::string::npos);
  CHECK(!std::filesystem::exists(dir / "o/adapter_model.safetensors"));
}

TEST_CASE("AdamW, schedules and clipping follow torch and transformers", "[worker]") {
  at::Tensor p = at::tensor({1.0f, -2.0f}).requires_grad_(true);
  AdamW opt({p}, AdamWOptions{0.9, 0.999, 1e-8, 0.1});
  double m[2] = {0, 0}, v[2] = {0, 0}, x[2] = {1.0, -2.0};
  const double g[2][2] = {{0.5, -1.0}, {0.25, 2.0}};
  for (int step = 1; step <= 2; ++step) {
    p.mutable_grad() =
        at::tensor({static_cast<float>(g[step - 1][0]), static_cast<float>(g[step - 1][1])});
    opt.Step(0.01);
    for (int i = 0; i < 2; ++i) {
      x[i] *= 1 - 0.01 * 0.1;
      m[i] = 0.9 * m[i] + 0.1 * g[step - 1][i];
      v[i] = 0.999 * v[i] + 0.001 * g[step - 1][i] * g[step - 1][i];
      const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(0.999, step)) + 1e-8;
      x[i] -= 0.01 / (1 - std::pow(0.9, step)) * m[i] / denom;
      CHECK(p[i].item<double>() == Approx(x[i]).epsilon(1e-6));
    }
  }
  CHECK(ScheduleFactor("constant", 0, 0, 10) == 1.0);
  CHECK(ScheduleFactor("linear", 1, 2, 10) == 0.5);
  CHECK(ScheduleFactor("linear", 6, 2, 10) == Approx(0.5));
  CHECK(ScheduleFactor("cosine", 2, 2, 10) == Approx(1.0));
  CHECK(ScheduleFactor("cosine", 6, 2, 10) == Approx(0.5));
  CHECK(ScheduleFactor("cosine", 10, 2, 10) == Approx(0.0).margin(1e-12));

  at::Tensor a = at::zeros({2}).requires_grad_(true), b = at::zeros({1}).requires_grad_(true);
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  CHECK(ClipGradNormAsync({a, b}, 1.0).item<double>() == Approx(5.0));
  CHECK(b.grad()[0].item<double>() == Approx(0.8).epsilon(1e-5));
  // The clip stays on the device: the same factor, the norm left as an f32 scalar where the
  // gradients are; below max_norm nothing changes, and without gradients there is no norm.
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  const at::Tensor norm = ClipGradNormAsync({a, b}, 1.0);
  REQUIRE(norm.defined());
  CHECK(norm.dim() == 0);
  CHECK(norm.scalar_type() == at::kFloat);
  CHECK(norm.item<double>() == Approx(5.0));
  CHECK(at::equal(a.grad(), at::tensor({3.0f, 0.0f}) * (at::reciprocal(at::tensor(5.0f) + 1e-6))));
  CHECK(ClipGradNormAsync({a, b}, 10.0).item<double>() == Approx(1.0).epsilon(1e-5));
  CHECK(b.grad()[0].item<double>() == Approx(0.8).epsilon(1e-5));
  at::Tensor c = at::zeros({1}).requires_grad_(true);
  CHECK(!ClipGradNormAsync({c}, 1.0).defined());
}

TEST_CASE("AdamW updates in runs of bounded scratch, bit for bit the same as all at once",
          "[worker]") {
  // Parameters of uneven sizes (one larger than the smallest bound), some without a
  // gradient; the bound cuts the list in many places, one place, or none.
  const std::vector<int64_t> sizes = {5, 300, 1, 64, 7, 1000, 33, 2};
  auto make = [&] {
    std::vector<at::Tensor> ps;
    for (size_t i = 0; i < sizes.size(); ++i)
      ps.push_back(at::linspace(-1.0, 1.0 + static_cast<double>(i), sizes[i]).requires_grad_(true));
    return ps;
  };
  std::vector<std::vector<at::Tensor>> sets;
  std::vector<std::unique_ptr<AdamW>> opts;
  for (uint64_t scratch : {uint64_t{1}, uint64_t{1500}, kOptimizerScratchBytes}) {
    sets.push_back(make());
    opts.push_back(
        std::make_unique<AdamW>(sets.back(), AdamWOptions{0.9, 0.95, 1e-6, 0.05, scratch}));
  }
  at::manual_seed(3);
  for (int step = 0; step < 3; ++step) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < sizes.size(); ++i) grads.push_back(at::randn({sizes[i]}));
    for (size_t k = 0; k < sets.size(); ++k) {
      for (size_t i = 0; i < sizes.size(); ++i)
        sets[k][i].mutable_grad() = (i == 2 && step == 1) ? at::Tensor() : grads[i].clone();
      opts[k]->Step(1e-2);
    }
  }
  for (size_t k = 1; k < sets.size(); ++k)
    for (size_t i = 0; i < sizes.size(); ++i) {
      CHECK(at::equal(sets[k][i], sets[0][i]));
      CHECK(at::equal(opts[k]->exp_avg()[i], opts[0]->exp_avg()[i]));
      CHECK(at::equal(opts[k]->exp_avg_sq()[i], opts[0]->exp_avg_sq()[i]));
    }
  // Every parameter moved (none skipped at a run's edge), the one without a gradient at one
  // step less.
  const std::vector<at::Tensor> start = make();
  for (size_t i = 0; i < sizes.size(); ++i) CHECK(!at::equal(sets[0][i], start[i]));
}

TEST_CASE("lorastream-worker train runs a job file and prints progress", "[worker]") {
  testing::TempDir dir("cli");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 3, 10, 30, 512);
  {
    std::ofstream job(dir / "job.toml");
    job << "name = \"cli\"\n[model]\ncheckpoint = \"" << (dir / "m") << "\"\n[data]\npath = \""
        << (dir / "d.jsonl")
        << "\"\nseq_len = 16\n[lora]\nrank = 2\n[train]\nsteps = 2\noutput_dir = \""
        << (dir / "out") << "\"\n";
  }
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  const std::string cmd =
      bin + " train " + (dir / "job.toml") + " --threads 1 > " + (dir / "log") + " 2>&1";
  CHECK(std::system(cmd.c_str()) == 0);
  const std::string log = testing::ReadFile(dir / "log");
  INFO(log);
  CHECK(log.find("step 1/2 loss ") != std::string::npos);
  CHECK(log.find("step 2/2 loss ") != std::string::npos);
  CHECK(log.find("tok/s") != std::string::npos);
  CHECK(log.find("eta") != std::string::npos);
  CHECK(std::filesystem::exists(dir / "out/adapter_config.json"));

  {
    std::ofstream job(dir / "bad.toml");
    job << "[model]\ncheckpoint = \"" << (dir / "m") << "\"\n[data]\npath = \"" << (dir / "d.jsonl")
        << "\"\n[lora]\nrank = 0\n[train]\nsteps = 2\noutput_dir = \"" << (dir / "out2") << "\"\n";
  }
  const std::string bad = bin + " train " + (dir / "bad.toml") + " > " + (dir / "log2") + " 2>&1";
  CHECK(std::system(bad.c_str()) != 0);
  CHECK(testing::ReadFile(dir / "log2").find("lora.rank") != std::string::npos);
}

TEST_CASE("lorastream-worker train saves a checkpoint on SIGTERM and exits 143", "[worker]") {
  testing::TempDir dir("sigterm");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 3, 10, 30, 512);
  {
    std::ofstream job(dir / "job.toml");
    job << "name = \"sig\"\n[model]\ncheckpoint = \"" << (dir / "m") << "\"\n[data]\npath = \""
        << (dir / "d.jsonl") << "\"\nseq_len = 16\n[lora]\nrank = 2\n[train]\nsteps = 100000\n"
        << "output_dir = \"" << (dir / "out") << "\"\n";
  }
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  SpawnOptions so;
  so.log_path = dir / "log";
  Subprocess p = Subprocess::Spawn({bin, "train", dir / "job.toml", "--threads", "1"}, so);
  // Wait (with a deadline) for training to be under way, then ask it to stop.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (testing::ReadFile(dir / "log").find("step 2/100000") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline && p.Running())
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  p.Signal(SIGTERM);
  CHECK(p.Wait(120) == 143);
  const std::string log = testing::ReadFile(dir / "log");
  INFO(log);
  CHECK_THAT(log, Catch::Contains("stopped by signal 15 at step"));
  const std::string checkpoint = FindResumableCheckpoint(dir / "out");
  CHECK(!checkpoint.empty());
  CHECK(CheckpointStepOf(std::filesystem::path(checkpoint).filename().string()) >= 2);
}

TEST_CASE("a run resumed after a crash writes each step to stats.jsonl once", "[worker]") {
  testing::TempDir dir("stats-resume");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 3, 10, 30, 512);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "out");
  spec.train.steps = 6;
  spec.train.checkpoint_every = 4;
  TrainOptions o;
  o.threads = 1;  // 2 cores shared with the rest of CI: more threads only spin
  RunTraining(spec, o);
  // As if the process had died after step 6 was recorded but before its checkpoint was: the
  // resume starts from checkpoint-4 and trains steps 5 and 6 again.
  std::filesystem::remove_all(dir / "out/checkpoint-6");
  const TrainResult r = RunTraining(spec, o);
  CHECK(r.start_step == 4);
  std::ifstream lines(dir / "out/stats.jsonl");
  std::vector<int64_t> steps;
  for (std::string line; std::getline(lines, line);)
    steps.push_back(nlohmann::json::parse(line)["step"].get<int64_t>());
  CHECK(steps == std::vector<int64_t>{1, 2, 3, 4, 5, 6});
}

TEST_CASE("lorastream-worker train over a checkpoint past the job's steps says it is complete",
          "[worker]") {
  testing::TempDir dir("complete");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 3, 10, 30, 512);
  const auto write_job = [&](int steps) {
    std::ofstream job(dir / "job.toml", std::ios::trunc);
    job << "name = \"again\"\n[model]\ncheckpoint = \"" << (dir / "m") << "\"\n[data]\npath = \""
        << (dir / "d.jsonl") << "\"\nseq_len = 16\n[lora]\nrank = 2\n[train]\nsteps = " << steps
        << "\noutput_dir = \"" << (dir / "out") << "\"\n";
  };
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  const std::string cmd =
      bin + " train " + (dir / "job.toml") + " --threads 1 > " + (dir / "log") + " 2>&1";
  write_job(3);
  REQUIRE(std::system(cmd.c_str()) == 0);
  write_job(2);  // fewer steps than its checkpoint-3 holds
  CHECK(std::system(cmd.c_str()) == 0);
  const std::string log = testing::ReadFile(dir / "log");
  INFO(log);
  CHECK_THAT(log, Catch::Contains("already complete: "));
  CHECK_THAT(log, Catch::Contains("checkpoint-3 is at step 3, at or past the job's last step "
                                  "(train.steps = 2); nothing trained"));
  CHECK_THAT(log, !Catch::Contains("done:") && !Catch::Contains("final loss"));
}

TEST_CASE("the progress line shows streaming and peak memory only when there are some",
          "[worker]") {
  StepStats s;
  s.step = 3;
  s.total_steps = 10;
  s.loss = 1.5;
  s.tokens_per_second = 1234;
  const std::string plain = FormatProgress(s, 65);
  CHECK_THAT(plain, Catch::StartsWith("step 3/10 loss 1.5000 "));
  CHECK_THAT(plain, Catch::Contains("tok/s 1234 eta 1m05s"));
  CHECK_THAT(plain, !Catch::Contains("h2d") && !Catch::Contains("peak"));
  s.h2d_bytes = 2500000000;
  s.copies = 20;
  s.copies_saved = 4;
  s.stall_seconds = 0.0342;
  s.peak_device_bytes = uint64_t{8} << 30;
  const std::string streamed = FormatProgress(s, 3700);
  CHECK_THAT(streamed, Catch::Contains("eta 1h01m"));
  CHECK_THAT(streamed, Catch::Contains("h2d 2.50GB stall 34.2ms copies 20 (+4 reused)"));
  CHECK_THAT(streamed, Catch::Contains("peak 8.00 GiB"));
  CHECK_THAT(streamed, !Catch::Contains("eval"));
  s.eval_loss = 2.25;
  CHECK_THAT(FormatProgress(s, 1), Catch::EndsWith(" eval 2.2500"));
}

TEST_CASE("a stop asked in the middle of a step ends it at the next block", "[worker]") {
  testing::TempDir dir("midstep");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 4, 10, 40, 512);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "out");
  spec.train.steps = 3;
  TrainOptions o;
  o.threads = 1;
  int asks = 0;
  // Asked once before step 1, then before each block it acquires: the third ask is inside
  // step 1, which therefore never completes.
  TrainResult r = RunTraining(spec, o, {}, [&] { return ++asks >= 3; });
  CHECK(r.stopped);
  CHECK(r.steps_done == 0);
  CHECK(asks == 3);
  CHECK(std::filesystem::exists(dir / "out/checkpoint-0/adapter_model.safetensors"));
  // Resumed, it trains to the end.
  CHECK(RunTraining(spec, o).steps_done == 3);
}

TEST_CASE("--profile records the asked steps: a Chrome trace and a table of operators",
          "[worker]") {
  testing::TempDir dir("profile");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 2, 32, 32, 512);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "a");
  spec.train.steps = 5;
  TrainOptions o;
  o.threads = 1;
  o.profile.path = dir / "trace.json";
  o.profile.first = 2;
  o.profile.steps = 3;
  std::vector<double> profiled_losses, plain_losses;
  RunTraining(spec, o, [&](const StepStats& s) { profiled_losses.push_back(s.loss); });
  // The trace is JSON with the operators of the window; the table names the window and
  // its heaviest operators, the matrix products among them.
  const nlohmann::json trace = nlohmann::json::parse(testing::ReadFile(dir / "trace.json"));
  REQUIRE(trace.contains("traceEvents"));
  size_t mm = 0;
  for (const auto& e : trace["traceEvents"])
    if (e.value("name", "") == "aten::mm" || e.value("name", "") == "aten::addmm") ++mm;
  CHECK(mm > 0);
  const std::string table = testing::ReadFile(dir / "trace.json.md");
  CHECK_THAT(table, Catch::Contains("# Profile of steps 2 to 4") && Catch::Contains("| aten::") &&
                        Catch::Contains("ms a step"));
  // Profiling changes no result.
  spec.train.output_dir = dir / "b";
  o.profile.path.clear();
  RunTraining(spec, o, [&](const StepStats& s) { plain_losses.push_back(s.loss); });
  CHECK(profiled_losses == plain_losses);
  CHECK(Adapter(dir / "a") == Adapter(dir / "b"));

  // Bad options are refused before anything trains, naming the option or the file.
  for (auto [first, steps, path, words] :
       std::vector<std::tuple<int64_t, int64_t, std::string, std::string>>{
           {0, 1, dir / "t.json", "--profile-from must be 1 or more"},
           {1, 0, dir / "t.json", "--profile-steps must be 1 or more"},
           {1, 1, dir / "no/such/t.json", "cannot write " + (dir / "no/such/t.json")}}) {
    StepProfileOptions p{path, first, steps};
    try {
      CheckStepProfile(p);
      FAIL("accepted " << words);
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Catch::Contains(words));
    }
  }
}
