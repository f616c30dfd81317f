// A user's first hour with `up`, `down` and the client verbs: `up` serves the base its jobs
// need (or refuses before starting anything, naming the job), `down` stops a detached cluster,
// and a verb with no coordinator fails at once naming the socket file.
#include <chrono>
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "cluster_fixture.h"
#include "common/base/error.h"
#include "common/job/job_paths.h"
#include "common/job/job_spec.h"
#include "coordinator/cli/local_cluster.h"
#include "coordinator/cli/up.h"
#include "store/synth_flux.h"
#include "store/synth_qwen_image.h"

using namespace lorastream;
using namespace lorastream::cli;
using lorastream::testing::Cluster;
using lorastream::testing::TempDir;
using lorastream::testing::WaitFor;
namespace fs = std::filesystem;

namespace {

const std::string kConfigs = std::string(LORASTREAM_SOURCE_DIR) + "/configs";
const std::string kFluxJob = kConfigs + "/jobs/flux_tiny.toml";
const std::string kLlamaJob = kConfigs + "/jobs/tiny_llama.toml";
// Names its checkpoint, qwen_image.safetensors beside it (configs/jobs/).
const std::string kQwenImageJob = kConfigs + "/jobs/qwen_image_tiny.toml";

std::string Write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

// A synthetic qwen-image-tiny checkpoint written into `dir` (its single file,
// DIR/qwen_image.safetensors, as `lorastream-synth --preset qwen-image-tiny --out DIR`).
void SynthQwenImage(const std::string& dir) {
  store::SynthOptions so;
  so.preset = "qwen-image-tiny";
  so.out_dir = dir;
  so.presets_dir = kConfigs + "/models";
  store::RunSynthQwenImage(so, store::PresetPath(so.preset, so.presets_dir));
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("up serves the family and the base its jobs name", "[coordinator][up]") {
  UpOptions o;
  UpModel m = ChooseUpModel(o, {kFluxJob}, kConfigs);
  CHECK(m.family == ModelFamily::kFlux);
  CHECK(m.preset == "flux-tiny");
  CHECK(m.model_dir.empty());
  m = ChooseUpModel(o, {kLlamaJob}, kConfigs);
  CHECK(m.family == ModelFamily::kLlm);
  CHECK(m.preset == "tiny");
  m = ChooseUpModel(o, {}, kConfigs);  // the example jobs of the default preset's family
  CHECK(m.family == ModelFamily::kLlm);

  // A job naming a checkpoint (relative to its own folder): that checkpoint is served.
  TempDir dir("up-base");
  fs::create_directories(dir / "model");
  const std::string a = Write(dir / "a.toml", "name = \"a\"\n[model]\ncheckpoint = \"model\"\n");
  m = ChooseUpModel(o, {a, kLlamaJob}, kConfigs);
  CHECK(m.model_dir == dir / "model");
  CHECK(m.family == ModelFamily::kLlm);
  // A FLUX job's checkpoint: model.checkpoint, or flux.checkpoint written as one [flux] section.
  const std::string shared = Write(dir / "shared.toml",
                                   "[model]\ncheckpoint = \"flux1.safetensors\"\n[train]\n"
                                   "output_dir = \"o\"\n[flux]\ncache_dir = \"c\"\n");
  const std::string single =
      Write(dir / "single.toml",
            "[flux]\ncheckpoint = \"flux1.safetensors\"\ncache_dir = \"c\"\noutput_dir = \"o\"\n");
  for (const std::string& job : {shared, single}) {
    INFO(job);
    m = ChooseUpModel(o, {job}, kConfigs);
    CHECK(m.family == ModelFamily::kFlux);
    CHECK(m.model_dir == dir / "flux1.safetensors");
  }

  // Qwen-Image: the checkpoint its job names (model.checkpoint, beside the job file) ...
  m = ChooseUpModel(o, {kQwenImageJob}, kConfigs);
  CHECK(m.family == ModelFamily::kQwenImage);
  CHECK(m.model_dir == kConfigs + "/jobs/qwen_image.safetensors");
  // ... without one (model.store), its family's tiny preset ...
  const std::string qi =
      Write(dir / "qi.toml", "[model]\nstore = \"any\"\n[qwen_image]\ncache_dir = \"c\"\n");
  m = ChooseUpModel(o, {qi}, kConfigs);
  CHECK(m.family == ModelFamily::kQwenImage);
  CHECK(m.preset == "qwen-image-tiny");
  CHECK(m.model_dir.empty());
  UpOptions preset = o;  // ... or that preset named, with no job
  preset.preset = "qwen-image-tiny";
  preset.preset_given = true;
  CHECK(ChooseUpModel(preset, {}, kConfigs).family == ModelFamily::kQwenImage);
  // ... and --model: the folder lorastream-synth wrote (its single file is served), the file
  // itself, or a diffusers folder.
  SynthQwenImage(dir / "qi-model");
  const std::string file = dir / "qi-model" + "/" + store::kSynthQwenImageFile;
  for (const std::string& model : {dir / "qi-model", file}) {
    UpOptions given = o;
    given.model_dir = model;
    m = ChooseUpModel(given, {qi, kQwenImageJob}, kConfigs);
    CHECK(m.family == ModelFamily::kQwenImage);
    CHECK(m.model_dir == model);
    CHECK(ServedCheckpoint(model) == file);
  }
  fs::create_directories(dir / "qi-diffusers/transformer");
  Write(dir / "qi-diffusers/transformer/config.json",
        "{\"_class_name\": \"QwenImageTransformer2DModel\"}");
  UpOptions diffusers = o;
  diffusers.model_dir = dir / "qi-diffusers";
  CHECK(ChooseUpModel(diffusers, {qi}, kConfigs).family == ModelFamily::kQwenImage);
}

TEST_CASE("a job file as a cluster submits it: its store, output folder and absolute paths",
          "[coordinator][up]") {
  TempDir dir("up-job-text");
  auto submitted = [&](const std::string& job, std::string* replaced) {
    return ParseJobSpec(ClusterJobText(job, "the-store", dir / "adapters/x", replaced), "x.toml");
  };
  // The example FLUX job (every family's sections): [model] store and [train] output_dir.
  std::string replaced;
  JobSpec s = submitted(kFluxJob, &replaced);
  REQUIRE(s.is_flux);
  CHECK(s.flux.store == "the-store");
  CHECK(s.flux.checkpoint.empty());
  CHECK(s.flux.output_dir == dir / "adapters/x");
  CHECK(replaced == ResolveJobPath("../../runs/jobs/flux-tiny-demo", kConfigs + "/jobs"));
  CHECK(s.flux.cache_dir == ResolveJobPath("../data/flux-tiny", kConfigs + "/jobs"));
  CHECK(s.flux.steps == 20);
  CHECK(s.flux.save_every == 10);

  // A FLUX job written as one [flux] section (the same keys in [flux]) and in the shared form:
  // a checkpoint's single blocks per unit dropped (the store's units are fixed), the paths
  // made absolute.
  const std::string single = Write(dir / "single.toml",
                                   "[flux]\ncheckpoint = \"m.safetensors\"\nsingles_per_unit = 4\n"
                                   "cache_dir = \"c\"\noutput_dir = \"o\"\ninit_from = \"a\"\n");
  const std::string shared =
      Write(dir / "shared.toml",
            "[model]\ncheckpoint = \"m.safetensors\"\n[lora]\ninit_from = \"a\"\n[train]\n"
            "output_dir = \"o\"\n[flux]\ncache_dir = \"c\"\nsingles_per_unit = 4\n");
  for (const std::string& job : {single, shared}) {
    INFO(job);
    s = submitted(job, &replaced);
    REQUIRE(s.is_flux);
    CHECK(s.flux_form_note.empty() == (job == shared));
    CHECK(s.flux.store == "the-store");
    CHECK(s.flux.checkpoint.empty());
    CHECK(s.flux.singles_per_unit == FluxJob{}.singles_per_unit);
    CHECK(s.flux.output_dir == dir / "adapters/x");
    CHECK(replaced == dir / "o");
    CHECK(s.flux.cache_dir == dir / "c");
    CHECK(s.flux.init_from == dir / "a");
  }

  // An LLM job: [model] store and [train] output_dir, its data made absolute.
  s = submitted(kLlamaJob, &replaced);
  CHECK_FALSE(s.is_flux);
  CHECK(s.model.store == "the-store");
  CHECK(s.train.output_dir == dir / "adapters/x");
  CHECK(s.data.path == ResolveJobPath("../data/tiny.jsonl", kConfigs + "/jobs"));
}

TEST_CASE("up refuses, before starting anything, jobs it cannot serve, naming the job",
          "[coordinator][up]") {
  UpOptions o;
  auto refusal = [&](const UpOptions& options, const std::vector<std::string>& jobs) {
    try {
      ChooseUpModel(options, jobs, kConfigs);
    } catch (const Error& e) {
      return std::make_pair(e.code(), std::string(e.what()));
    }
    FAIL("not refused");
    return std::make_pair(ErrorCode::kOk, std::string());
  };
  auto [code, why] = refusal(o, {kLlamaJob, kFluxJob});  // LLM and FLUX jobs mixed
  CHECK(code == ErrorCode::kInvalidArgument);
  CHECK_THAT(why, Catch::Contains(kFluxJob) && Catch::Contains("a FLUX.1 job"));

  UpOptions tiny = o;  // --preset tiny named for a FLUX job
  tiny.preset_given = true;
  std::tie(code, why) = refusal(tiny, {kFluxJob});
  CHECK_THAT(why, Catch::Contains(kFluxJob) && Catch::Contains("--preset tiny") &&
                      Catch::Contains("flux-tiny"));

  TempDir dir("up-refuse");
  fs::create_directories(dir / "llm");
  Write(dir / "llm/config.json", "{\"model_type\": \"llama\"}");
  UpOptions llm = o;  // --model an LLM's folder for a FLUX job
  llm.model_dir = dir / "llm";
  std::tie(code, why) = refusal(llm, {kFluxJob});
  CHECK_THAT(why, Catch::Contains(kFluxJob) && Catch::Contains("an LLM checkpoint"));

  const std::string a = Write(dir / "a.toml", "[model]\ncheckpoint = \"/models/a\"\n");
  const std::string b = Write(dir / "b.toml", "[model]\ncheckpoint = \"/models/b\"\n");
  std::tie(code, why) = refusal(o, {a, b});  // two bases
  CHECK_THAT(why, Catch::Contains(b) && Catch::Contains("/models/a"));

  // Qwen-Image beside another family, either way round: both files named.
  std::tie(code, why) = refusal(o, {kQwenImageJob, kLlamaJob});
  CHECK(code == ErrorCode::kInvalidArgument);
  CHECK_THAT(why, Catch::Contains(kLlamaJob) && Catch::Contains("an LLM job") &&
                      Catch::Contains(kQwenImageJob) &&
                      Catch::Contains("a Qwen-Image job ([qwen_image])"));
  std::tie(code, why) = refusal(o, {kFluxJob, kQwenImageJob});
  CHECK(code == ErrorCode::kInvalidArgument);
  CHECK_THAT(why, Catch::Contains(kQwenImageJob) && Catch::Contains("a Qwen-Image job") &&
                      Catch::Contains(kFluxJob) && Catch::Contains("a FLUX.1 job"));
  // --preset of another family for jobs naming no checkpoint: named, with the jobs' family's
  // preset.
  const std::string qi =
      Write(dir / "qi.toml", "[model]\nstore = \"any\"\n[qwen_image]\ncache_dir = \"c\"\n");
  std::tie(code, why) = refusal(tiny, {qi});
  CHECK(code == ErrorCode::kInvalidArgument);
  CHECK_THAT(why, Catch::Contains(qi) && Catch::Contains("--preset tiny is an LLM") &&
                      Catch::Contains("(qwen-image-tiny)"));
  UpOptions qi_preset = o;
  qi_preset.preset = "qwen-image-tiny";
  qi_preset.preset_given = true;
  std::tie(code, why) = refusal(qi_preset, {kFluxJob});
  CHECK_THAT(why, Catch::Contains(kFluxJob) &&
                      Catch::Contains("--preset qwen-image-tiny is a Qwen-Image model") &&
                      Catch::Contains("(flux-tiny)"));
  // --model of another family, either way round.
  std::tie(code, why) = refusal(llm, {kQwenImageJob});
  CHECK(code == ErrorCode::kInvalidArgument);
  CHECK_THAT(why, Catch::Contains(kQwenImageJob) && Catch::Contains("an LLM checkpoint"));
  SynthQwenImage(dir / "qi");
  UpOptions qi_model = o;
  qi_model.model_dir = dir / "qi";
  std::tie(code, why) = refusal(qi_model, {kLlamaJob});
  CHECK(code == ErrorCode::kInvalidArgument);
  CHECK_THAT(why, Catch::Contains(kLlamaJob) && Catch::Contains("is a Qwen-Image checkpoint"));
  std::tie(code, why) = refusal(qi_model, {kFluxJob});
  CHECK_THAT(why, Catch::Contains(kFluxJob) && Catch::Contains("is a Qwen-Image checkpoint"));
  // Two Qwen-Image jobs naming different checkpoints.
  const std::string c = Write(dir / "c.toml",
                              "[model]\ncheckpoint = \"/models/c.safetensors\"\n"
                              "[qwen_image]\ncache_dir = \"x\"\n");
  std::tie(code, why) = refusal(o, {kQwenImageJob, c});
  CHECK_THAT(why, Catch::Contains(c) && Catch::Contains(kConfigs + "/jobs/qwen_image.safetensors"));

  std::tie(code, why) = refusal(o, {dir / "missing.toml"});
  CHECK(code == ErrorCode::kNotFound);
  CHECK_THAT(why, Catch::Contains(dir / "missing.toml"));
}

TEST_CASE("a verb with no coordinator fails at once, naming the socket file",
          "[coordinator][cluster]") {
  Cluster c("no-socket");  // nothing listens, and no socket file exists
  int code = -1;
  const auto start = std::chrono::steady_clock::now();
  c.Cli({"--timeout", "60", "jobs"}, &code, 120);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string err = ReadText(c.dir() / "cli.stderr");
  INFO(err);
  CHECK(code == ExitCodeFor(ErrorCode::kNotFound));
  CHECK_THAT(err, Catch::Contains((c.dir() / "coordinator.sock").string() + " does not exist"));
  CHECK(took < 30);  // not the 60 s --timeout: it did not wait for a reply
}

TEST_CASE("down stops a detached cluster's parts in order and removes its socket",
          "[coordinator][cluster][up]") {
  Cluster c("down");
  c.StartCoordinator();
  Subprocess& worker = c.StartWorker("h", {"tiny:fp"});
  const fs::path socket = c.dir() / "coordinator.sock";
  REQUIRE(WaitFor([&] { return fs::exists(socket); }, 30));
  const fs::path run = c.dir() / "run";
  fs::create_directories(run);
  const nlohmann::json cluster{{"endpoint", c.endpoint()},
                               {"store", "tiny"},
                               {"parts",
                                {{{"part", "worker cpu"}, {"pid", worker.pid()}},
                                 {{"part", "coordinator"}, {"pid", c.coordinator().pid()}}}}};
  std::ofstream(run / "cluster.json") << cluster.dump();
  int code = -1;
  const std::string out =
      RunAndCapture({lorastream::testing::Bin("lorastream"), "down", run.string()}, &code, 120,
                    (c.dir() / "down.stderr").string());
  INFO(out << ReadText(c.dir() / "down.stderr"));
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("stopped worker cpu") && Catch::Contains("stopped coordinator"));
  CHECK(out.find("stopped worker cpu") < out.find("stopped coordinator"));
  CHECK_FALSE(worker.Running());
  CHECK_FALSE(c.coordinator().Running());
  CHECK_FALSE(fs::exists(socket));
  CHECK_FALSE(fs::exists(run / "cluster.json"));

  // A folder that holds no cluster: said so, exit 3.
  RunAndCapture({lorastream::testing::Bin("lorastream"), "down", run.string()}, &code, 60,
                (c.dir() / "down.stderr").string());
  CHECK(code == ExitCodeFor(ErrorCode::kNotFound));
  CHECK_THAT(ReadText(c.dir() / "down.stderr"), Catch::Contains("cluster.json does not exist"));
}

TEST_CASE("lorastream --version names the version, commit, LibTorch and CUDA", "[coordinator]") {
  int code = -1;
  const std::string out =
      RunAndCapture({lorastream::testing::Bin("lorastream"), "--version"}, &code, 60);
  INFO(out);
  CHECK(code == 0);
  CHECK_THAT(out, Catch::StartsWith("lorastream ") && Catch::Contains("(commit "));
  CHECK_THAT(
      out, Catch::Contains("LibTorch") && (Catch::Contains("CPU only") || Catch::Contains("CUDA")));
}
