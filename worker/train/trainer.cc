#include "worker/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/formats/checkpoint_dir.h"
#include "common/job/adapter_consumers.h"
#include "worker/train/group_members.h"
#include "worker/train/group_trainer.h"

namespace lorastream::worker {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

std::string FormatProgress(const StepStats& s, double eta) {
  char buf[256];
  const int64_t e = static_cast<int64_t>(std::max(0.0, eta) + 0.5);
  char eta_text[32];
  if (e >= 3600)
    std::snprintf(eta_text, sizeof eta_text, "%lldh%02lldm", static_cast<long long>(e / 3600),
                  static_cast<long long>(e / 60 % 60));
  else
    std::snprintf(eta_text, sizeof eta_text, "%lldm%02llds", static_cast<long long>(e / 60),
                  static_cast<long long>(e % 60));
  std::snprintf(buf, sizeof buf, "step %lld/%lld loss %.4f lr %.2e gnorm %.3f tok/s %.0f eta %s",
                static_cast<long long>(s.step), static_cast<long long>(s.total_steps), s.loss,
                s.learning_rate, s.grad_norm, s.tokens_per_second, eta_text);
  std::string line = buf;
  if (s.h2d_bytes > 0 || s.copies > 0) {
    std::snprintf(buf, sizeof buf, " h2d %.2fGB stall %.1fms copies %lld (+%lld reused)",
                  static_cast<double>(s.h2d_bytes) / 1e9, s.stall_seconds * 1e3,
                  static_cast<long long>(s.copies), static_cast<long long>(s.copies_saved));
    line += buf;
  }
  if (s.peak_device_bytes > 0) line += " peak " + FormatBytes(s.peak_device_bytes, 2);
  if (s.has_eval()) {
    std::snprintf(buf, sizeof buf, " eval %.4f", s.eval_loss);
    line += buf;
  }
  return line;
}

TrainResult RunTraining(const JobSpec& spec, const TrainOptions& options,
                        const std::function<void(const StepStats&)>& on_step,
                        const std::function<bool()>& should_stop) {
  GroupTrainer group(spec, options);
  group.Add(GroupJob{spec, on_step, should_stop, {}});
  group.Run();
  std::vector<GroupJobOutcome> left = group.TakeLeft();
  LS_CHECK(left.size() == 1, "a group of one job left with another count of jobs");
  if (left[0].error) std::rethrow_exception(left[0].error);
  return left[0].result;
}

namespace {

// A job's progress line per step, with its ETA from the steps run so far (prefixed by the
// job's name in a group).
std::function<void(const StepStats&)> PrintProgress(std::string prefix) {
  const auto start = Clock::now();
  return [start, prefix = std::move(prefix), first_step = int64_t{-1}](const StepStats& s) mutable {
    if (first_step < 0) first_step = s.step - 1;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const double per_step = elapsed / static_cast<double>(s.step - first_step);
    std::printf("%s%s\n", prefix.c_str(),
                FormatProgress(s, per_step * static_cast<double>(s.total_steps - s.step)).c_str());
    std::fflush(stdout);
  };
}

// What the adapter's consumers require (common/job/adapter_consumers.h), on stderr.
void WarnForConsumers(const JobSpec& spec) {
  for (const std::string& w : AdapterConsumerWarnings(spec))
    std::fprintf(stderr, "%s: warning: %s\n", spec.name.c_str(), w.c_str());
}

// With train.keep_best: where the best checkpoint's adapter is (OUTPUT_DIR/best/), the line
// after the last.
void PrintBest(const std::string& prefix, const std::string& output_dir) {
  const std::string best = output_dir.empty() ? "" : BestAdapterDir(output_dir);
  if (best.empty()) return;
  std::string which;
  try {
    std::ifstream in(best + "/" + kBestAdapterNote);
    const nlohmann::json note = nlohmann::json::parse(in);
    which = " (" + note.value("checkpoint", std::string("?")) + ", eval loss " +
            std::to_string(note.value("eval_loss", 0.0)).substr(0, 6) + ")";
  } catch (const std::exception&) {
    // best.json unreadable: the folder is still named
  }
  std::printf("%sbest adapter%s in %s\n", prefix.c_str(), which.c_str(), best.c_str());
}

// The lines a job ends with; returns the command's status for it.
int PrintEnd(const std::string& prefix, const TrainResult& r, int stop_signal, int64_t steps) {
  if (r.stopped) {
    std::printf(
        "%sstopped by signal %d at step %lld: checkpoint in %s (run the same command "
        "to resume)\n",
        prefix.c_str(), stop_signal, static_cast<long long>(r.steps_done),
        r.checkpoint_dir.c_str());
    return 128 + stop_signal;
  }
  if (r.start_step > 0 && r.steps_done == r.start_step) {  // nothing left to train
    std::printf("%salready complete: %s is at step %lld, at or past the job's last step",
                prefix.c_str(), r.checkpoint_dir.c_str(), static_cast<long long>(r.start_step));
    if (steps > 0) std::printf(" (train.steps = %lld)", static_cast<long long>(steps));
    std::printf("; nothing trained, adapter in %s\n", r.adapter_dir.c_str());
    PrintBest(prefix, r.adapter_dir);
    return 0;
  }
  // The family's end line (its steps, loss and adapter files), each line under the prefix.
  size_t from = 0;
  while (from <= r.done_line.size()) {
    const size_t end = std::min(r.done_line.find('\n', from), r.done_line.size());
    std::printf("%s%s\n", prefix.c_str(), r.done_line.substr(from, end - from).c_str());
    from = end + 1;
  }
  PrintBest(prefix, r.adapter_dir);
  return 0;
}

}  // namespace

int RunTrainCommand(const std::string& job_path, const TrainOptions& options,
                    const std::atomic<int>* stop_signal) {
  JobSpec spec = LoadJobSpec(job_path);
  WarnForConsumers(spec);
  auto should_stop = [stop_signal] { return stop_signal && stop_signal->load() != 0; };
  TrainResult r = RunTraining(spec, options, PrintProgress(""), should_stop);
  return PrintEnd("", r, r.stopped ? stop_signal->load() : 0, spec.train.steps);
}

int RunGroupTrainCommand(const std::vector<std::string>& job_paths, const TrainOptions& options,
                         const std::atomic<int>* stop_signal) {
  if (job_paths.size() == 1) return RunTrainCommand(job_paths[0], options, stop_signal);
  auto should_stop = [stop_signal] { return stop_signal && stop_signal->load() != 0; };
  std::vector<GroupJob> jobs;
  std::vector<int64_t> steps;  // each job's train.steps, by its index in the group
  for (const std::string& path : job_paths) {
    GroupJob job;
    job.spec = LoadJobSpec(path);
    WarnForConsumers(job.spec);
    steps.push_back(job.spec.train.steps);
    job.on_step = PrintProgress(job.spec.name + ": ");
    job.should_stop = should_stop;
    jobs.push_back(std::move(job));
  }
  int status = 0;
  for (const GroupJobOutcome& out : RunGroupTraining(std::move(jobs), options)) {
    const std::string prefix = out.name + ": ";
    if (out.error) {
      std::printf("%sfailed: %s\n", prefix.c_str(), FailureMessage(out.error).c_str());
      status = std::max(status, 1);
      continue;
    }
    status =
        std::max(status, PrintEnd(prefix, out.result, out.result.stopped ? stop_signal->load() : 0,
                                  steps[out.index]));
  }
  std::fflush(stdout);
  return status;
}

}  // namespace lorastream::worker
