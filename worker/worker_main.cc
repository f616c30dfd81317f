// lorastream-worker: `train JOB.toml...` runs one job, or several as one group, standalone; `plan
// JOB.toml` prints the streaming plans the cost model weighs; `parity` is the parity harness's side
// (tools/parity/); `quant-report JOB.toml` compares compressed bases with the bf16 one. Thin: parse
// options, call one Run function, map errors.
#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/base/cli_main.h"
#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/manifest.h"
#include "common/formats/toml_file.h"
#include "common/job/job_spec.h"
#include "common/posix/gpu_info.h"
#include "common/posix/regular_file.h"
#include "common/posix/user_access.h"
#include "coordinator/client/build_info.h"
#include "coordinator/client/curve.h"
#include "store/attach.h"
#include "store/manifest_object.h"
#include "worker/families.h"
#include "worker/serve/merge.h"
#include "worker/serve/parity.h"
#include "worker/serve/plan_command.h"
#include "worker/serve/quant_report.h"
#include "worker/serve/serve.h"
#include "worker/stream/host_register_probe.h"
#include "worker/train/group_trainer.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"

namespace {
std::atomic<bool> g_stop_serving{false};
std::atomic<bool> g_hold_at_checkpoint{false};
void OnStopSignal(int) { g_stop_serving = true; }
// `train`: the first SIGINT/SIGTERM asks for a checkpoint at the next step boundary; a second
// one ends the process at once (the handler gives the signal its default action back).
std::atomic<int> g_train_stop_signal{0};
void OnTrainStopSignal(int signo) {
  g_train_stop_signal = signo;
  std::signal(signo, SIG_DFL);
}
void OnHoldSignal(int) { g_hold_at_checkpoint = true; }
void OnResumeSignal(int) { g_hold_at_checkpoint = false; }
}  // namespace

int main(int argc, char** argv) {
  using namespace lorastream;
  using namespace lorastream::worker;
  CLI::App app{"lorastream-worker: trains LoRA adapters against a store's base weights"};
  app.require_subcommand(1);

  std::vector<std::string> job_paths;
  TrainOptions train;
  bool no_resume = false;
  auto* train_cmd = app.add_subcommand(
      "train", "run a job file standalone; several: one group (each block copied once for all)");
  train_cmd->add_option("jobs", job_paths, "the job files (TOML)")->required();
  CLI::Option* train_device =
      train_cmd->add_option("--device", train.device,
                            "cpu | cuda | cuda:N (default: cuda:0 when this CUDA build sees a "
                            "GPU, else cpu)");
  train_cmd->add_option("--threads", train.threads, "CPU threads (0 = every core)");
  train_cmd->add_flag("--no-resume", no_resume,
                      "start fresh even when output_dir has a checkpoint");
  train_cmd->add_option("--profile", train.profile.path,
                        "record steps with LibTorch's profiler: FILE gets the Chrome trace, "
                        "FILE.md the kernels (on the CPU, the operators) that took the time");
  train_cmd
      ->add_option("--profile-from", train.profile.first,
                   "the first profiled step of this run, counting from 1 (earlier steps "
                   "warm up)")
      ->capture_default_str();
  train_cmd->add_option("--profile-steps", train.profile.steps, "how many steps to profile")
      ->capture_default_str();
  bool train_resident = false;
  train_cmd->add_flag("--resident", train_resident,
                      "keep every block resident, ignoring [stream] (no streaming engine)");

  ParityOptions parity;
  auto* parity_cmd =
      app.add_subcommand("parity", "logits, loss and LoRA gradients for tools/parity");
  auto* parity_model =
      parity_cmd->add_option("--model", parity.model_dir, "Hugging Face checkpoint folder");
  parity_cmd
      ->add_option("--store", parity.store_name,
                   "a published store instead (a compressed one computes with its expansion)")
      ->excludes(parity_model);
  parity_cmd->add_option("--tokens", parity.tokens_path, "safetensors with input_ids [B, S] (I64)")
      ->required();
  parity_cmd->add_option("--adapter", parity.adapter_dir,
                         "peft adapter folder (absent: a fresh one)");
  parity_cmd->add_option("--out", parity.out_dir, "output folder")->required();
  parity_cmd->add_option("--dtype", parity.dtype, "f32 | bf16")->capture_default_str();
  parity_cmd->add_option("--device", parity.device, "cpu | cuda:N")->capture_default_str();
  parity_cmd->add_option("--repeat", parity.timing_repeats, "timed training steps (speed)");
  parity_cmd->add_option("--rank", parity.rank, "rank of a fresh adapter when --adapter is absent");
  parity_cmd->add_option("--taped", parity.taped_blocks,
                         "timed steps: the last N blocks keep their activations, no recompute "
                         "(-1: all)");

  // serve: take jobs from a coordinator (worker/serve/serve.h; the coordinator engineer's part).
  worker::ServeOptions serve;
  bool serve_resident = false;
  auto* serve_cmd =
      app.add_subcommand("serve", "take jobs from a coordinator until SIGINT/SIGTERM");
  serve.coordinator = client::DefaultEndpoint();
  serve_cmd->add_option("--coordinator", serve.coordinator, "coordinator endpoint")
      ->envname("LORASTREAM_COORDINATOR")
      ->capture_default_str();
  std::string store_user;
  for (CLI::App* cmd : {train_cmd, serve_cmd})
    cmd->add_option("--store-user", store_user,
                    "trust stores served by this user (default: the worker's own user)");
  serve_cmd->add_option("--device", serve.device, "cpu | cuda:N")->capture_default_str();
  serve_cmd->add_option("--store", serve.stores,
                        "store to offer, NAME or AS=NAME: the store NAME of this host for jobs "
                        "whose model.store is AS (repeatable; default: every live store)");
  serve_cmd
      ->add_option("--store-wait", serve.store_wait_s,
                   "seconds a named store may take to be published (a large model loads for "
                   "minutes)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  serve_cmd
      ->add_option("--curve-keys", serve.curve_keys, "CURVE keys folder from `lorastream keygen`")
      ->envname("LORASTREAM_CURVE_KEYS");
  serve_cmd->add_option("--threads", serve.threads, "CPU threads (0 = every core)");
  serve_cmd
      ->add_option("--jobs", serve.jobs,
                   "job slots: train up to K jobs at once as one job group (default: 1 on the "
                   "CPU; on a GPU one per 20 GiB of its memory, at most 4)")
      ->check(CLI::Range(1, 64));
  serve_cmd->add_flag("--resident", serve_resident,
                      "keep every block resident (no streaming engine)");

  std::vector<std::string> plan_jobs;
  PlanCommandOptions plan;
  auto* plan_cmd = app.add_subcommand(
      "plan",
      "the candidate swap plans with predicted step time and peak memory, and the chosen one");
  plan_cmd->add_option("jobs", plan_jobs, "the job file (TOML); several: one group's plans")
      ->required();
  plan_cmd->add_option("--device", plan.device, "cpu | cuda | cuda:N")->capture_default_str();
  plan_cmd->add_flag("--recalibrate", plan.recalibrate,
                     "measure the device again even when cached figures exist");

  QuantReportOptions report;
  auto* report_cmd = app.add_subcommand(
      "quant-report",
      "weight SQNR, logits' KL divergence and trained eval loss of fp8/nf4 bases against bf16");
  report_cmd->add_option("job", report.job_path, "job file: [model] checkpoint, data, [eval]")
      ->required();
  report_cmd->add_option("--device", report.device, "cpu | cuda:N")->capture_default_str();
  report_cmd->add_option("--formats", report.formats, "fp8,nf4 (any of them)")
      ->capture_default_str();
  report_cmd->add_option("--kl-batches", report.kl_batches, "eval batches for the KL divergence")
      ->capture_default_str();
  report_cmd->add_option("--threads", report.threads, "store packing threads (0: all cores)");
  report_cmd->add_option("--out", report.out_path, "JSON file of the figures");

  MergeOptions merge;
  auto* merge_cmd = app.add_subcommand(
      "merge", "fold LoRA adapters into the base and write it as the family's checkpoint");
  merge_cmd
      ->add_option("--base", merge.base,
                   "Hugging Face checkpoint folder (LLM), BFL's single file or a diffusers "
                   "folder (FLUX.1), or the name of a store lorastream-store serves")
      ->required();
  merge_cmd
      ->add_option("--adapter", merge.adapters,
                   "DIR[:WEIGHT]: a peft adapter folder (LLM) or a kohya file or the folder "
                   "holding adapter_kohya.safetensors (FLUX); repeatable, weight 1 by default")
      ->required();
  merge_cmd
      ->add_option("--out", merge.out,
                   "output folder (LLM; FLUX.1 as diffusers) or file (FLUX.1 as BFL's)")
      ->required();
  merge_cmd->add_option("--format", merge.format,
                        "FLUX.1: bfl (one file) | diffusers (a folder with transformer/); "
                        "default: the base's own form (a store's: bfl)");
  merge_cmd->add_option("--dtype", merge.dtype, "bf16 | f32")->capture_default_str();
  merge_cmd->add_flag("--force", merge.force, "replace an existing output");
  merge_cmd->add_flag("--progress,!--no-progress", merge.progress, "no progress lines on stderr");

  // doctor's real test of read-only host registration (hidden: not a user command).
  int probe_device = 0;
  auto* probe_cmd = app.add_subcommand("probe-host-register", "")->group("");
  probe_cmd->add_option("--device-index", probe_device, "CUDA device index");

  return RunMain("lorastream-worker", app, argc, argv, [&]() -> int {
    // `train` without --device: the GPU when there is one this build can use, said in a line;
    // a CPU-only build on a GPU machine trains on the CPU, and warns.
    std::string device_note;
    if (*train_cmd && train_device->count() == 0) {
      const size_t gpus = ListGpus().size();
      if (gpus > 0 && client::ThisBuild().cuda) {
        train.device = "cuda:0";
        device_note = "training on cuda:0: this machine has " + std::to_string(gpus) +
                      " NVIDIA GPU(s) (--device cpu trains on the CPU)";
      } else if (gpus > 0) {
        device_note = "training on the CPU although this machine has " + std::to_string(gpus) +
                      " NVIDIA GPU(s): this build is CPU-only (" + client::BuildSummary() +
                      "); rebuild for CUDA with `tools/setup.sh`";
      }
    }
    // A CPU-only build asked for a GPU says so in one line before it starts anything.
    const std::string device = *train_cmd    ? train.device
                               : *serve_cmd  ? serve.device
                               : *plan_cmd   ? plan.device
                               : *report_cmd ? report.device
                                             : parity.device;
    // (Only a CPU-only build asks which GPUs the host has: nvidia-smi takes a moment.)
    if (!client::ThisBuild().cuda &&
        (*train_cmd || *serve_cmd || *parity_cmd || *plan_cmd || *report_cmd)) {
      std::string problem = client::CudaBuildProblem({device}, ListGpus().size());
      if (!problem.empty()) throw Error(ErrorCode::kUnsupported, problem);
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
    if (*merge_cmd) {
      RunMerge(merge);
      return 0;
    }
    InitLogging("worker");
    if (!device_note.empty() && train.device == "cpu")
      LS_LOG_WARN("{}", device_note);
    else if (!device_note.empty())
      LS_LOG_INFO("{}", device_note);
    if (!store_user.empty()) store::SetTrustedStoreOwner(LookupUser(store_user).uid);
    if (*train_cmd) {
      train.resume = !no_resume;
      CheckStepProfile(train.profile);  // before the model loads
      // Say when a job's base is compressed (fp8, NF4): its weights are approximate.
      for (const std::string& path : job_paths) {
        try {
          const JobSpec spec = ParseJobSpec(ReadRegularFile(path, kMaxTomlBytes, "job file"), path);
          if (spec.model.store.empty()) continue;
          const auto record = store::ReadManifestObject(spec.model.store);
          if (!record || record->json.empty()) continue;
          const Manifest m = ManifestFromJson(record->json, "store `" + spec.model.store + "`");
          if (const std::string c = m.DescribeCompression(); !c.empty())
            LS_LOG_INFO(
                "{}: the base, store `{}`, is compressed ({}): its weights approximate "
                "the original's (`lorastream-worker quant-report` measures how closely)",
                path, spec.model.store, c.substr(2));
        } catch (const Error&) {
          // The trainer reports what is wrong with the job or its store.
        }
      }
      // The job's [stream] section plans residency and streaming, as under `serve`.
      if (!train_resident)
        train.make_provider = [](const JobSpec& spec, const BaseWeights& base,
                                 const std::string& device, const std::string& dtype,
                                 const std::vector<JobSpec>& group) {
          return MakeStreamProvider(spec, base, device, dtype, {}, group);
        };
      RequireOneFamily(job_paths);
      std::signal(SIGINT, OnTrainStopSignal);
      std::signal(SIGTERM, OnTrainStopSignal);
      return RunGroupTrainCommand(job_paths, train, &g_train_stop_signal);
    }
    if (*plan_cmd) return RunFamilyPlanCommand(plan_jobs, plan);
    if (*report_cmd) return RunQuantReport(report);
    if (*serve_cmd) {
      serve.stream = !serve_resident;
      std::signal(SIGINT, OnStopSignal);
      std::signal(SIGTERM, OnStopSignal);
      std::signal(SIGUSR1, OnHoldSignal);
      std::signal(SIGUSR2, OnResumeSignal);
      serve.hold_at_checkpoint = &g_hold_at_checkpoint;
      return worker::RunServe(serve, g_stop_serving);
    }
    RunParity(parity);
    return 0;
  });
}
