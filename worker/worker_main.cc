// lorastream-worker: `train JOB.toml` runs one job standalone; `parity` is the parity
// harness's side (tools/parity/). Thin: parse options, call one Run function, map errors.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "common/error.h"
#include "common/gpu_info.h"
#include "common/log.h"
#include "coordinator/build_info.h"
#include "worker/host_register_probe.h"
#include "worker/parity.h"
#include "worker/serve.h"
#include "worker/stream_provider.h"
#include "worker/trainer.h"

namespace {
std::atomic<bool> g_stop_serving{false};
std::atomic<bool> g_hold_at_checkpoint{false};
void OnStopSignal(int) { g_stop_serving = true; }
void OnHoldSignal(int) { g_hold_at_checkpoint = true; }
void OnResumeSignal(int) { g_hold_at_checkpoint = false; }
}  // namespace

int main(int argc, char** argv) {
  using namespace lorastream;
  CLI::App app{"lorastream-worker: trains LoRA adapters against a store's base weights"};
  app.require_subcommand(1);

  std::string job_path;
  TrainOptions train;
  bool no_resume = false;
  auto* train_cmd = app.add_subcommand("train", "run one job file standalone");
  train_cmd->add_option("job", job_path, "the job file (TOML)")->required();
  train_cmd->add_option("--device", train.device, "cpu | cuda | cuda:N")->capture_default_str();
  train_cmd->add_option("--threads", train.threads, "CPU threads (0 = every core)");
  train_cmd->add_flag("--no-resume", no_resume, "start fresh even when output_dir has a checkpoint");
  bool train_resident = false;
  train_cmd->add_flag("--resident", train_resident,
                      "keep every block resident, ignoring [stream] (no streaming engine)");

  ParityOptions parity;
  auto* parity_cmd = app.add_subcommand("parity", "logits, loss and LoRA gradients for tools/parity");
  parity_cmd->add_option("--model", parity.model_dir, "Hugging Face checkpoint folder")->required();
  parity_cmd->add_option("--tokens", parity.tokens_path, "safetensors with input_ids [B, S] (I64)")->required();
  parity_cmd->add_option("--adapter", parity.adapter_dir, "peft adapter folder (absent: a fresh one)");
  parity_cmd->add_option("--out", parity.out_dir, "output folder")->required();
  parity_cmd->add_option("--dtype", parity.dtype, "f32 | bf16")->capture_default_str();
  parity_cmd->add_option("--device", parity.device, "cpu | cuda:N")->capture_default_str();
  parity_cmd->add_option("--repeat", parity.timing_repeats, "timed training steps (speed)");
  parity_cmd->add_option("--rank", parity.rank, "rank of a fresh adapter when --adapter is absent");

  // serve: take jobs from a coordinator (worker/serve.h; the coordinator engineer's part).
  ServeOptions serve;
  bool serve_resident = false;
  auto* serve_cmd = app.add_subcommand("serve", "take jobs from a coordinator until SIGINT/SIGTERM");
  serve_cmd->add_option("--coordinator", serve.coordinator, "coordinator endpoint, e.g. tcp://127.0.0.1:5757")
      ->required()->envname("LORASTREAM_COORDINATOR");
  serve_cmd->add_option("--device", serve.device, "cpu | cuda:N")->capture_default_str();
  serve_cmd->add_option("--store", serve.stores, "store to offer (repeatable; default: every live store)");
  serve_cmd->add_option("--curve-keys", serve.curve_keys, "CURVE keys folder from `lorastream keygen`")
      ->envname("LORASTREAM_CURVE_KEYS");
  serve_cmd->add_option("--threads", serve.threads, "CPU threads (0 = every core)");
  serve_cmd->add_flag("--resident", serve_resident, "keep every block resident (no streaming engine)");

  // doctor's real test of read-only host registration (hidden: not a user command).
  int probe_device = 0;
  auto* probe_cmd = app.add_subcommand("probe-host-register", "")->group("");
  probe_cmd->add_option("--device-index", probe_device, "CUDA device index");

  CLI11_PARSE(app, argc, argv);
  // A CPU-only build asked for a GPU says so in one line before it starts anything.
  const std::string device = *train_cmd ? train.device : *serve_cmd ? serve.device : parity.device;
  // (Only a CPU-only build asks which GPUs the host has: nvidia-smi takes a moment.)
  if (!ThisBuild().cuda && (*train_cmd || *serve_cmd || *parity_cmd)) {
    if (std::string problem = CudaBuildProblem({device}, ListGpus().size()); !problem.empty()) {
      std::fprintf(stderr, "lorastream-worker: unsupported: %s\n", problem.c_str());
      return ExitCodeFor(ErrorCode::kUnsupported);
    }
  }
  if (*probe_cmd) {
#if LORASTREAM_HAVE_CUDA
    const nlohmann::json r = ProbeHostRegister(probe_device);
#else
    const nlohmann::json r{{"ok", nullptr}, {"error", "not applicable: a CPU-only build"}};
#endif
    std::printf("%s\n", r.dump().c_str());
    return 0;
  }
  InitLogging("worker");
  try {
    if (*train_cmd) {
      train.resume = !no_resume;
      // The job's [stream] section plans residency and streaming, as under `serve`.
      if (!train_resident)
        train.make_provider = [](const JobSpec& spec, const BaseWeights& base,
                                 const std::string& device, const std::string& dtype) {
          return MakeStreamProvider(spec, base, device, dtype);
        };
      return RunTrainCommand(job_path, train);
    }
    if (*serve_cmd) {
      serve.stream = !serve_resident;
      std::signal(SIGINT, OnStopSignal);
      std::signal(SIGTERM, OnStopSignal);
      std::signal(SIGUSR1, OnHoldSignal);
      std::signal(SIGUSR2, OnResumeSignal);
      serve.hold_at_checkpoint = &g_hold_at_checkpoint;
      return RunServe(serve, g_stop_serving);
    }
    RunParity(parity);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "lorastream-worker: %s: %s\n", ErrorCodeName(e.code()), e.what());
    return ExitCodeFor(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorastream-worker: internal error: %s\n", e.what());
    return ExitCodeFor(ErrorCode::kInternal);
  }
}
