// TEST DRIVER, not product code: a worker process built from the torch-free WorkerAgent with
// a simple slot runner, so that the coordinator's multi-process tests (scheduling, job slots,
// cancel, SIGKILL, restart) run without LibTorch. The runner imitates the job group's
// contract: the jobs of its slots step together, one step each per group step, on one thread;
// each resumes from OUTPUT_DIR/checkpoint (the last checkpointed step), reports every step,
// writes a checkpoint every `train.checkpoint_every` steps, saves OUTPUT_DIR/adapter when it
// completes or is stopped, and appends "attempt pid step group" to OUTPUT_DIR/steps.log (group:
// how many jobs stepped together) so tests can see who ran which step and with whom.
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include <CLI/CLI.hpp>

#include "common/base/log.h"
#include "coordinator/client/worker_agent.h"

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
  app.add_option("--jobs", options.slots, "job slots (jobs stepped together)");
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

  // One job of the imitated group.
  struct Job {
    std::shared_ptr<const JobContext> ctx;
    std::filesystem::path dir;
    int64_t step = 0;
    std::ofstream log;
  };
  auto end = [](JobSlots& slots, Job& job, JobResult::Kind kind, const std::string& adapter) {
    WriteAtomically(job.dir / "adapter", adapter + " " + std::to_string(job.step) + "\n");
    JobResult result;
    result.kind = kind;
    result.final_step = job.step;
    result.adapter_path = (job.dir / "adapter").string();
    slots.Finish(*job.ctx, result);
  };
  SlotRunner runner = [&](JobSlots& slots) {
    std::vector<Job> jobs;
    while (true) {
      // New jobs join at the group's step boundary; with none running, wait for one.
      for (auto& ctx : slots.Take(jobs.empty())) {
        Job job;
        job.ctx = ctx;
        job.dir = ctx->assignment.spec.train.output_dir;
        std::filesystem::create_directories(job.dir);
        job.step = ReadCheckpoint(job.dir);
        job.log.open(job.dir / "steps.log", std::ios::app);
        jobs.push_back(std::move(job));
      }
      if (jobs.empty()) return;  // the agent stops
      for (auto it = jobs.begin(); it != jobs.end();) {
        const bool stop = it->ctx->should_stop();
        if (stop || it->step >= it->ctx->assignment.spec.train.steps) {
          end(slots, *it, stop ? JobResult::Kind::kStopped : JobResult::Kind::kCompleted,
              stop ? "stopped at" : "completed");
          it = jobs.erase(it);
        } else {
          ++it;
        }
      }
      if (jobs.empty()) continue;
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
      const size_t group = jobs.size();
      for (auto it = jobs.begin(); it != jobs.end();) {
        Job& job = *it;
        const JobSpec& spec = job.ctx->assignment.spec;
        ++job.step;
        // Several problems, one per line, as RequireValidJobSpec reports them; the job fails
        // alone, the others step on.
        if (job.step == fail_at) {
          const Error error(ErrorCode::kRefused, "test failure at step " +
                                                     std::to_string(job.step) +
                                                     ":\n  first problem\n  second problem");
          slots.Finish(*job.ctx, FailedResult(std::make_exception_ptr(error), job.ctx->assignment));
          it = jobs.erase(it);
          continue;
        }
        job.log << job.ctx->assignment.attempt << " " << getpid() << " " << job.step << " " << group
                << std::endl;
        StepStats s;
        s.step = job.step;
        s.total_steps = spec.train.steps;
        s.loss = 10.0 / job.step;
        s.tokens = 1024;
        s.step_seconds = step_ms / 1000.0;
        s.tokens_per_second = 1024 / s.step_seconds;
        s.h2d_bytes = 1 << 20;  // the group's copies: one set, whatever its size
        s.h2d_busy_seconds = 0.001;
        if (spec.eval.every > 0 && job.step % spec.eval.every == 0) {  // an imitated evaluation
          s.eval_loss = 20.0 / static_cast<double>(job.step);
          s.eval_tokens = 64;
        }
        job.ctx->report_step(s);
        if (spec.train.checkpoint_every > 0 && job.step % spec.train.checkpoint_every == 0) {
          WriteAtomically(job.dir / "checkpoint", std::to_string(job.step) + "\n");
          job.ctx->report_checkpoint(job.step, (job.dir / "checkpoint").string());
        }
        ++it;
      }
    }
  };
  WorkerAgent agent(options, runner);
  agent.Run(g_stop);
  return 0;
}
