// lora.init_from / flux.init_from: a job starts from an adapter one already has. With learning
// rate 0 it comes out as it went in, bit for bit; the settings it leaves out are the adapter's;
// a setting that differs is refused naming both values.
#include "torch_catch.h"  // first: see there

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/job/flux_job.h"
#include "common/job/job_spec.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/flux_checkpoint.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_checkpoint.h"
#include "worker/flux/flux_train.h"
#include "worker/model/lora.h"
#include "worker/model/peft_config.h"
#include "worker/train/trainer.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

// Every tensor of a safetensors file, by name: dtype, shape and bytes.
std::map<std::string, std::string> Tensors(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::Open(path);
  std::map<std::string, std::string> out;
  for (const SafetensorsEntry& e : f.tensors())
    out[e.name] = std::string(DTypeName(e.dtype)) + ShapeString(e.shape) +
                  std::string(reinterpret_cast<const char*>(f.Data(e)), e.nbytes());
  return out;
}

std::string Message(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("lora.init_from: left-out settings are the adapter's, and survive the journal's TOML",
          "[worker][init_from]") {
  const JobSpec s = ParseJobSpec(
      "[model]\ncheckpoint = \"m\"\n[data]\npath = \"d.jsonl\"\n[lora]\ninit_from = \"prev\"\n"
      "[train]\nsteps = 1\noutput_dir = \"out\"\n",
      "job.toml");
  CHECK(s.lora.init_from == "prev");
  CHECK(s.lora.rank == 0);
  CHECK(s.lora.alpha == 0);
  CHECK(s.lora.targets.empty());
  const JobSpec again = ParseJobSpec(JobSpecToToml(s), "job.toml");
  CHECK(again.lora.init_from == "prev");
  CHECK(again.lora.rank == 0);
  CHECK(again.lora.targets.empty());
  // Without init_from, rank 0 is still refused.
  JobSpec plain = s;
  plain.lora.init_from.clear();
  bool rank_refused = false;
  for (const std::string& p : ValidateJobSpec(plain))
    rank_refused |= p.find("lora.rank") != std::string::npos;
  CHECK(rank_refused);
}

TEST_CASE("lora.init_from: with lr 0 the adapter comes out bit for bit; mismatches are refused",
          "[worker][init_from]") {
  testing::TempDir dir("init-from");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 4, 32, 32, 512);
  TrainOptions o;
  o.threads = 1;
  // A trained adapter (B non-zero) to start from.
  JobSpec first = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "first");
  first.lora.targets = {"q_proj", "v_proj", "down_proj"};
  first.train.steps = 2;
  RunTraining(first, o);

  JobSpec next = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "next");
  next.lora.init_from = dir / "first";
  next.lora.rank = 0;  // as a job file leaving rank, alpha and targets out reads
  next.lora.alpha = 0;
  next.lora.targets.clear();
  next.optim.lr = 0;
  next.train.steps = 2;
  const TrainResult r = RunTraining(next, o);
  CHECK(r.steps_done == 2);
  CHECK(Tensors(dir / "next/adapter_model.safetensors") ==
        Tensors(dir / "first/adapter_model.safetensors"));
  const LoraSettings saved = ReadPeftConfig(dir / "next/adapter_config.json");
  CHECK(saved.rank == 4);
  CHECK(saved.alpha == 8);
  CHECK(saved.TargetNames() == std::vector<std::string>{"down_proj", "q_proj", "v_proj"});

  // The job's own settings must agree: the message names both values.
  JobSpec bad = next;
  bad.train.output_dir = dir / "bad";
  bad.lora.rank = 8;
  bad.lora.alpha = 8;
  bad.lora.targets = {"q_proj", "v_proj", "down_proj"};
  const std::string why = Message([&] { RunTraining(bad, o); });
  INFO(why);
  CHECK(why.find("lora.rank is 8") != std::string::npos);
  CHECK(why.find("rank 4") != std::string::npos);
  bad.lora.rank = 4;
  bad.lora.targets = {"q_proj"};
  const std::string why_targets = Message([&] { RunTraining(bad, o); });
  CHECK(why_targets.find("lora.targets is [q_proj]") != std::string::npos);
  CHECK(why_targets.find("[down_proj, q_proj, v_proj]") != std::string::npos);
}

TEST_CASE("flux.init_from: with learning rate 0 the kohya file comes out bit for bit",
          "[worker][init_from][flux]") {
  using namespace lorastream::worker::flux;
  testing::TempDir dir("flux-init-from");
  const std::string d = dir.str();
  lorastream::testing::MakeFluxCheckpoint(d + "/model");
  std::filesystem::create_directories(d + "/cache");
  const FluxCacheShape shape = lorastream::testing::TinyCacheShape();
  lorastream::testing::WriteFluxCache(d + "/cache", "cat", 32, 32, shape, 1);
  lorastream::testing::WriteFluxCache(d + "/cache", "dog", 32, 32, shape, 2);
  FluxJob first;
  first.checkpoint = d + "/model/flux1.safetensors";
  first.cache_dir = d + "/cache";
  first.output_dir = d + "/first";
  first.steps = 2;
  first.rank = 4;
  first.alpha = 8;
  first.targets = {"attention"};
  first.learning_rate = 1e-3;
  const FluxTrainResult trained = TrainFlux(first, {});

  FluxJob next = first;
  next.output_dir = d + "/next";
  next.init_from = d + "/first";  // the folder: its adapter_kohya.safetensors
  next.rank = 0;                  // left out: the file's
  next.alpha = 0;
  next.targets.clear();
  next.learning_rate = 0;
  next.seed = 9;
  const FluxTrainResult r = TrainFlux(next, {});
  CHECK(r.steps.size() == 2);
  CHECK(Tensors(r.kohya_path) == Tensors(trained.kohya_path));

  FluxJob bad = next;
  bad.output_dir = d + "/bad";
  bad.rank = 16;
  const std::string why = Message([&] { TrainFlux(bad, {}); });
  INFO(why);
  CHECK(why.find("flux.rank is 16") != std::string::npos);
  CHECK(why.find("rank 4") != std::string::npos);
  // A job written in the shared form is told its keys as its file writes them.
  bad.shared_form = true;
  bad.targets = {"all"};
  const std::string shared_why = Message([&] { TrainFlux(bad, {}); });
  INFO(shared_why);
  CHECK(shared_why.find("lora.rank is 16 but the file lora.init_from names") != std::string::npos);
  CHECK(shared_why.find("lora.targets is [img_attn.proj, img_attn.qkv, img_mlp.0") !=
        std::string::npos);
  CHECK(shared_why.find("flux.rank") == std::string::npos);
  // Parsed from a job file: left-out keys read as the file's (0, 0, []).
  const std::string job = d + "/job.toml";
  std::ofstream(job) << "[flux]\ncheckpoint = \"model/flux1.safetensors\"\ncache_dir = \"cache\"\n"
                        "output_dir = \"out\"\ninit_from = \"first\"\n";
  const FluxJob parsed = LoadFluxJob(job);
  CHECK(parsed.rank == 0);
  CHECK(parsed.targets.empty());
  CHECK(parsed.init_from == d + "/first");
}
