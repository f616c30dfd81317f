// TEST DRIVER, not product code: a worker process built from the torch-free WorkerAgent with
// a simple job runner, so that the coordinator's multi-process tests (scheduling, cancel,
// SIGKILL, restart) run without LibTorch. The runner imitates the trainer's contract:
// resumes from OUTPUT_DIR/checkpoint (the last checkpointed step), reports every step,
// writes a checkpoint every `train.checkpoint_every` steps, saves OUTPUT_DIR/adapter when it
// completes or is stopped, and appends "attempt pid step" to OUTPUT_DIR/steps.log so tests
// can see who ran which step.
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include <CLI/CLI.hpp>

#include "common/log.h"
#include "coordinator/worker_agent.h"

namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

void WriteAtomically(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
  }
  std::filesystem::rename(tmp, path);
}

int64_t ReadCheckpoint(const std::filesystem::path& dir) {
  std::ifstream in(dir / "checkpoint");
  int64_t step = 0;
  return (in >> step) ? step : 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastream;
  using namespace lorastream::client;
  CLI::App app{"lorastream test worker (test driver)"};
  WorkerAgentOptions options;
  std::vector<std::string> stores;
  int step_ms = 50;
  int64_t fail_at = -1;
  app.add_option("--coordinator", options.client.endpoint)->required();
  app.add_option("--curve-keys", options.client.curve_keys_dir);
  app.add_option("--device", options.device);
  app.add_option("--host", options.host);
  app.add_option("--store", stores, "NAME:FINGERPRINT");
  app.add_option("--step-ms", step_ms);
  app.add_option("--fail-at-step", fail_at);
  CLI11_PARSE(app, argc, argv);
  for (const std::string& s : stores) {
    size_t colon = s.find(':');
    options.stores.push_back(
        StoreInfo{s.substr(0, colon), colon == std::string::npos ? "" : s.substr(colon + 1)});
  }
  options.client.timeout_ms = 2000;
  options.retry_interval_s = 0.2;
  InitLogging("test-worker", "info");
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  JobRunner runner = [&](const JobContext& ctx) {
    const JobSpec& spec = ctx.assignment.spec;
    std::filesystem::path dir = spec.train.output_dir;
    std::filesystem::create_directories(dir);
    int64_t step = ReadCheckpoint(dir);
    std::ofstream log(dir / "steps.log", std::ios::app);
    JobResult result;
    while (step < spec.train.steps) {
      if (ctx.should_stop()) {
        WriteAtomically(dir / "adapter", "stopped at " + std::to_string(step) + "\n");
        result.kind = JobResult::Kind::kStopped;
        result.final_step = step;
        result.adapter_path = (dir / "adapter").string();
        return result;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
      ++step;
      // Several problems, one per line, as RequireValidJobSpec reports them.
      if (step == fail_at)
        throw Error(ErrorCode::kRefused, "test failure at step " + std::to_string(step) +
                                             ":\n  first problem\n  second problem");
      log << ctx.assignment.attempt << " " << getpid() << " " << step << std::endl;
      StepStats s;
      s.step = step;
      s.total_steps = spec.train.steps;
      s.loss = 10.0 / step;
      s.tokens = 1024;
      s.step_seconds = step_ms / 1000.0;
      s.tokens_per_second = 1024 / s.step_seconds;
      s.h2d_bytes = 1 << 20;
      s.h2d_busy_seconds = 0.001;
      if (spec.eval.every > 0 && step % spec.eval.every == 0) {  // an imitated evaluation
        s.eval_loss = 20.0 / static_cast<double>(step);
        s.eval_tokens = 64;
      }
      ctx.report_step(s);
      if (spec.train.checkpoint_every > 0 && step % spec.train.checkpoint_every == 0) {
        WriteAtomically(dir / "checkpoint", std::to_string(step) + "\n");
        ctx.report_checkpoint(step, (dir / "checkpoint").string());
      }
    }
    WriteAtomically(dir / "adapter", "completed " + std::to_string(step) + "\n");
    result.kind = JobResult::Kind::kCompleted;
    result.final_step = step;
    result.adapter_path = (dir / "adapter").string();
    return result;
  };
  WorkerAgent agent(options, runner);
  agent.Run(g_stop);
  return 0;
}
