#include "coordinator/cli/up.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include <toml++/toml.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/job/job_paths.h"
#include "common/posix/gpu_info.h"
#include "common/posix/install_paths.h"
#include "coordinator/cli/down.h"
#include "coordinator/cli/local_cluster.h"
#include "coordinator/client/build_info.h"
#include "coordinator/client/curve.h"
#include "coordinator/daemon/tensorboard.h"
#include "store/synth_flux.h"
#include "store/synth_qwen_image.h"

namespace lorastream::cli {

namespace fs = std::filesystem;

std::string DefaultRunDir(const std::string& kind) {
  char stamp[32];
  std::time_t t = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&t));
  return (fs::current_path() / "runs" / (kind + "-" + stamp)).string();
}

namespace {

std::atomic<int> g_stop_signal{0};
void OnSignal(int sig) { g_stop_signal = sig; }

// The family of the job file at `path` (its sections); LLM when it cannot be read or parsed.
ModelFamily JobFileFamily(const std::string& path) {
  try {
    const toml::table job = toml::parse_file(path);
    return JobFamily(job.contains("flux"), job.contains("qwen_image"));
  } catch (const std::exception&) {
    return ModelFamily::kLlm;
  }
}

// The example jobs of the model's family: FLUX jobs for a FLUX.1 store, LLM jobs for an
// LLM's. The Qwen-Image example reads caches beside it (configs/jobs/qwen_image_tiny.toml):
// none to send without them.
std::vector<std::string> ExampleJobs(const std::string& configs_dir, ModelFamily family) {
  if (family == ModelFamily::kQwenImage)
    throw Error(ErrorCode::kInvalidArgument,
                "`up` has no Qwen-Image example job to send (the example reads caches beside "
                "it): name one with --job, e.g. " +
                    configs_dir +
                    "/jobs/qwen_image_tiny.toml copied beside `lorastream-synth --preset "
                    "qwen-image-tiny --out DIR --caches DIR/cache` (docs/QWEN_IMAGE.md)");
  std::vector<std::string> jobs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(configs_dir + "/jobs", ec)) {
    const std::string path = entry.path().string();
    if (entry.path().extension() == ".toml" && JobFileFamily(path) == family) jobs.push_back(path);
  }
  std::sort(jobs.begin(), jobs.end());
  if (jobs.empty())
    throw Error(ErrorCode::kNotFound, "no " + std::string(ModelFamilyName(family)) +
                                          " job files in " + configs_dir + "/jobs; name some");
  return jobs;
}

// What `up` says of a family's jobs in refusals, and the preset it synthesizes for them when
// neither --model nor --preset is given and they name no checkpoint.
struct UpFamily {
  ModelFamily family;
  const char* job;  // "an LLM job", "a FLUX.1 job ([flux])"
  const char* tiny_preset;
};

const UpFamily& Up(ModelFamily f) {
  static const UpFamily rows[] = {
      {ModelFamily::kLlm, "an LLM job", "tiny"},
      {ModelFamily::kFlux, "a FLUX.1 job ([flux])", "flux-tiny"},
      {ModelFamily::kQwenImage, "a Qwen-Image job ([qwen_image])", "qwen-image-tiny"},
  };
  for (const UpFamily& row : rows)
    if (row.family == f) return row;
  return rows[0];
}

// "an LLM", "a FLUX.1", "a Qwen-Image", before "checkpoint" or "model".
std::string Article(ModelFamily f) {
  return std::string(f == ModelFamily::kLlm ? "an " : "a ") + ModelFamilyName(f);
}

ModelFamily PresetFamily(const std::string& preset_path) {
  if (store::IsQwenImagePreset(preset_path)) return ModelFamily::kQwenImage;
  return store::IsFluxPreset(preset_path) ? ModelFamily::kFlux : ModelFamily::kLlm;
}

// "step 24/24, 9356 tok/s, stall 16%  eval loss 2.1034  " from a job's last step statistics
// and evaluation ("" before any).
std::string LastStepSummary(const nlohmann::json& job) {
  const auto it = job.find("last_stats");
  if (it == job.end() || !it->is_object()) return "";
  const nlohmann::json& s = *it;
  try {
    const double step_s = s.value("step_seconds", 0.0);
    char buf[128];
    std::snprintf(buf, sizeof buf, "step %lld/%lld, %.0f tok/s, stall %.0f%%  ",
                  static_cast<long long>(s.value("step", int64_t{0})),
                  static_cast<long long>(s.value("total_steps", int64_t{0})),
                  s.value("tokens_per_second", 0.0),
                  step_s > 0 ? 100.0 * s.value("stall_seconds", 0.0) / step_s : 0.0);
    std::string text = buf;
    const auto eval = job.find("last_eval_loss");
    if (eval != job.end() && eval->is_number()) {
      std::snprintf(buf, sizeof buf, "eval loss %.4f  ", eval->get<double>());
      text += buf;
    }
    return text;
  } catch (const nlohmann::json::exception&) {
    return "";  // a field of an unexpected type: leave the summary out
  }
}

}  // namespace

UpModel ChooseUpModel(const UpOptions& options, const std::vector<std::string>& jobs,
                      const std::string& configs_dir) {
  // Each job's family and the checkpoint it names (absolute), read before anything starts.
  struct JobBase {
    std::string path, checkpoint;
    ModelFamily family = ModelFamily::kLlm;
  };
  std::vector<JobBase> bases;
  for (const std::string& path : jobs) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec))
      throw Error(ErrorCode::kNotFound, "job file " + path + " does not exist");
    toml::table job;
    try {
      job = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      throw Error(ErrorCode::kInvalidArgument, path + ": " + std::string(e.description()));
    }
    JobBase b{path, "", JobFamily(job.contains("flux"), job.contains("qwen_image"))};
    // [model] checkpoint, or a FLUX job's flux.checkpoint when it is written as one [flux]
    // section (the shared form refuses that key in [flux]).
    const toml::node* checkpoint = job.at_path("model.checkpoint").node();
    if (b.family == ModelFamily::kFlux && job.at_path("flux.checkpoint").node())
      checkpoint = job.at_path("flux.checkpoint").node();
    if (checkpoint && checkpoint->is_string() && !checkpoint->as_string()->get().empty())
      b.checkpoint = ResolveJobPath(checkpoint->as_string()->get(), JobFileDir(path));
    bases.push_back(std::move(b));
  }
  for (const JobBase& b : bases)
    if (b.family != bases.front().family)
      throw Error(ErrorCode::kInvalidArgument,
                  "`up` serves one base for all its jobs: " + b.path + " is " + Up(b.family).job +
                      " but " + bases.front().path + " is " + Up(bases.front().family).job +
                      "; run them with two `lorastream up`s");

  UpModel model;
  model.preset = options.preset;
  if (!options.model_dir.empty()) {
    model.model_dir = options.model_dir;
    model.family = CheckpointFamily(ServedCheckpoint(options.model_dir));
    for (const JobBase& b : bases)
      if (b.family != model.family)
        throw Error(ErrorCode::kInvalidArgument,
                    b.path + " is " + Up(b.family).job + " but --model " + options.model_dir +
                        " is " + Article(model.family) + " checkpoint" +
                        ": give --model the jobs' base, or leave it out to serve " +
                        (b.checkpoint.empty() ? "the tiny preset of their family"
                                              : "the checkpoint they name"));
    return model;
  }
  for (const JobBase& b : bases) {
    if (b.checkpoint.empty()) continue;
    if (model.model_dir.empty()) {
      model.model_dir = b.checkpoint;
      model.family = b.family;
    } else if (b.checkpoint != model.model_dir) {
      throw Error(ErrorCode::kInvalidArgument,
                  "`up` serves one base for all its jobs: " + b.path + " names " + b.checkpoint +
                      " but another job names " + model.model_dir +
                      "; run them with two `lorastream up`s, or give --model");
    }
  }
  if (!model.model_dir.empty()) return model;
  // A synthetic preset: the jobs' family picks it unless --preset was given.
  if (!options.preset_given && !bases.empty()) model.preset = Up(bases.front().family).tiny_preset;
  model.family = PresetFamily(store::PresetPath(model.preset, configs_dir + "/models"));
  for (const JobBase& b : bases)
    if (b.family != model.family)
      throw Error(ErrorCode::kInvalidArgument,
                  b.path + " is " + Up(b.family).job + " but --preset " + model.preset + " is " +
                      Article(model.family) + " model: name a preset of the jobs' family (" +
                      Up(b.family).tiny_preset + "), or leave it out");
  return model;
}

int RunUp(const UpOptions& options) {
  // The base and the jobs, decided before anything starts: a job `up` cannot serve is refused
  // now, naming it.
  const std::string configs = options.configs_dir.empty() ? ConfigsDir() : options.configs_dir;
  std::vector<std::string> jobs = options.jobs;
  UpModel model = ChooseUpModel(options, jobs, configs);
  if (jobs.empty()) jobs = ExampleJobs(configs, model.family);

  LocalClusterOptions co;
  co.bin_dir = options.bin_dir.empty() ? SelfExeDir() : options.bin_dir;
  co.model_dir = model.model_dir;
  co.preset = model.preset;
  co.offer_own_store_only = true;  // its workers take only its jobs' base
  co.devices = options.devices.empty() ? DetectGpus() : options.devices;
  co.cpu_workers = options.cpu_workers;
  co.jobs_per_worker = options.jobs_per_worker;
  // --keep and --detach leave the cluster running after `up` ends.
  co.outlive_parent = options.keep || options.detach;
  if (!options.tensorboard_dir.empty()) {
    // Checked here, before anything starts: a bad folder is an error of this command.
    co.tensorboard_dir = coordinator::TensorBoardWriter(options.tensorboard_dir).dir();
  }
  // Before anything starts: a CPU-only build asked (or defaulting) to run CUDA workers.
  if (!client::ThisBuild().cuda) {
    std::string problem = client::CudaBuildProblem(co.devices, ListGpus().size());
    if (!problem.empty()) throw Error(ErrorCode::kUnsupported, problem);
  }
  co.run_dir = fs::absolute(options.run_dir.empty() ? DefaultRunDir("up") : options.run_dir);

  // The cluster's processes run in sessions of their own, so Ctrl-C reaches only `up` (and
  // the watch view), which then stops them in order: workers, coordinator, store.
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  LocalCluster cluster(co);
  std::printf("lorastream up: logs in %s\n", cluster.log_dir().c_str());
  std::fflush(stdout);
  cluster.Start();
  std::printf("store `%s` (%s), coordinator %s, %zu worker(s):", cluster.store_name().c_str(),
              cluster.model_dir().c_str(), cluster.endpoint().c_str(), cluster.num_workers());
  for (const auto& d : cluster.devices()) std::printf(" %s", d.c_str());
  if (options.jobs_per_worker > 0)
    std::printf(", each training up to %d jobs at once as one group", options.jobs_per_worker);
  std::printf("\n");
  for (const auto& job : jobs) {
    if (g_stop_signal) break;  // Ctrl-C during start-up: submit nothing more
    std::string replaced;
    int64_t id = cluster.Submit(job, &replaced);
    std::printf("submitted %s as job %lld\n", job.c_str(), static_cast<long long>(id));
    if (!replaced.empty())
      std::printf("  its output_dir %s is replaced by %s/adapters/%s\n", replaced.c_str(),
                  cluster.run_dir().c_str(), fs::path(job).stem().c_str());
  }
  std::fflush(stdout);
  if (options.detach && !g_stop_signal) {
    cluster.WritePidFile(cluster.run_dir() + "/pids");
    cluster.WriteClusterFile();
    WriteUpRecord(cluster.run_dir());
    std::printf(
        "--detach: the cluster runs on (coordinator %s, store `%s`).\n"
        "  lorastream --coordinator %s watch   # the live view\n"
        "  lorastream down %s   # stop it\n",
        cluster.endpoint().c_str(), cluster.store_name().c_str(), cluster.endpoint().c_str(),
        cluster.run_dir().c_str());
    cluster.Detach();
    return 0;
  }

  Subprocess watch;
  if (options.watch)
    watch = Subprocess::Spawn(
        {co.bin_dir + "/lorastream", "--coordinator", cluster.endpoint(), "watch"});
  // Until every job ends (or Ctrl-C): the view exits by itself when the jobs end.
  for (;;) {
    if (g_stop_signal) break;
    if (watch.valid() && !watch.Running()) break;
    if (!watch.valid()) {
      try {
        cluster.WaitForJobs(0.5);
        break;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout) throw;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (watch.valid()) watch.Stop(5);

  int status = 0;
  int code = 0;
  nlohmann::json jobs_json =
      nlohmann::json::parse(cluster.Client({"jobs", "--json"}, &code, 10), nullptr, false);
  std::printf("\n");
  if (!jobs_json.is_array()) status = 1;
  for (const auto& job : jobs_json.is_array() ? jobs_json : nlohmann::json::array()) {
    std::string state = job.value("state", "?");
    if (state != "succeeded") status = 1;
    std::string adapter = job.value("adapter_path", "");
    if (adapter.empty()) adapter = job.value("output_dir", "");
    std::printf(
        "job %-4lld %-24s %-10s %s%s%s\n", static_cast<long long>(job.value("id", 0)),
        job.value("name", "").c_str(), state.c_str(), LastStepSummary(job).c_str(), adapter.c_str(),
        job.value("reason", "").empty() ? "" : ("  (" + job.value("reason", "") + ")").c_str());
  }
  if (g_stop_signal) {
    std::printf("interrupted: stopping the cluster\n");
    status = 130;
  }
  if (options.keep && !g_stop_signal) {
    std::string pids = cluster.run_dir() + "/pids";
    cluster.WritePidFile(pids);
    cluster.WriteClusterFile();
    WriteUpRecord(cluster.run_dir());
    std::printf(
        "--keep: the cluster stays up (coordinator %s, store `%s`).\n"
        "  lorastream --coordinator %s submit JOB.toml   # more jobs\n"
        "  lorastream down %s   # stop it\n",
        cluster.endpoint().c_str(), cluster.store_name().c_str(), cluster.endpoint().c_str(),
        cluster.run_dir().c_str());
    cluster.Detach();
  } else {
    cluster.Stop();
    std::printf("stopped; logs in %s\n", cluster.log_dir().c_str());
  }
  return status;
}

}  // namespace lorastream::cli
