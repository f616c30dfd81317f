#include "worker/flux/flux_train.h"

#include <algorithm>
#include <cstdio>

#include "common/error.h"
#include "common/job_spec.h"
#include "worker/flux/flux_checkpoint.h"
#include "worker/flux/flux_group.h"
#include "worker/train/group_members.h"

namespace lorastream::worker::flux {

FluxTrainResult TrainFlux(const FluxJob& job, const FluxTrainOptions& options) {
  FluxTrainResult result;
  GroupJob one;
  one.spec = FluxJobSpec(job, "flux");
  one.on_step = [&result, &options](const StepStats& stats) {
    result.steps.push_back(stats);
    if (options.on_step) options.on_step(stats);
  };
  one.should_stop = [stop = options.stop] { return stop != nullptr && stop->load() != 0; };
  FluxGroupTrainer group(one.spec, options);
  group.Add(std::move(one));
  group.Run();
  const GroupJobOutcome out = group.TakeLeft().at(0);
  if (out.error) std::rethrow_exception(out.error);
  result.first_step = out.result.start_step;
  result.checkpoint_dir = out.result.checkpoint_dir;
  if (!result.steps.empty() && !out.result.adapter_dir.empty()) {
    result.kohya_path = out.result.adapter_dir + "/" + kKohyaAdapterFile;
    result.diffusers_path = out.result.adapter_dir + "/" + kDiffusersAdapterFile;
  }
  return result;
}

namespace {

// How a job ended, one line (prefixed by its name in a group); its exit status.
int PrintEnd(const std::string& prefix, const TrainResult& r, int64_t steps, double last_loss,
             int signal) {
  if (r.steps_done == r.start_step && !r.stopped) {
    std::printf(
        "%salready complete: %s is at step %lld, at or past the job's last step (flux.steps = "
        "%lld); nothing trained, adapters in %s\n",
        prefix.c_str(), r.checkpoint_dir.c_str(), static_cast<long long>(r.start_step),
        static_cast<long long>(steps), r.adapter_dir.c_str());
    return 0;
  }
  if (r.steps_done < steps) {
    std::printf(
        "%sstopped by signal %d at step %lld: checkpoint in %s (run the same command to "
        "resume)\n",
        prefix.c_str(), signal, static_cast<long long>(r.steps_done), r.checkpoint_dir.c_str());
    return 128 + signal;
  }
  std::printf(
      "%sdone: steps %lld..%lld, final loss %.6f\n%sadapter (kohya, ComfyUI/Forge): %s/%s\n"
      "%sadapter (diffusers load_lora_weights): %s/%s\n",
      prefix.c_str(), static_cast<long long>(r.start_step + 1),
      static_cast<long long>(r.steps_done), last_loss, prefix.c_str(), r.adapter_dir.c_str(),
      kKohyaAdapterFile, prefix.c_str(), r.adapter_dir.c_str(), kDiffusersAdapterFile);
  return 0;
}

}  // namespace

int RunFluxTrainCommand(const std::vector<std::string>& job_paths,
                        const FluxTrainOptions& options) {
  LS_CHECK(!job_paths.empty(), "a FLUX train command needs a job file");
  std::vector<GroupJob> jobs;
  for (const std::string& path : job_paths) {
    GroupJob job;
    job.spec = LoadJobSpec(path);
    if (!job.spec.is_flux)
      throw Error(ErrorCode::kRefused,
                  path +
                      ": not a FLUX job (it has no [flux] section); a FLUX group trains FLUX "
                      "jobs only");
    job.should_stop = [stop = options.stop] { return stop != nullptr && stop->load() != 0; };
    jobs.push_back(std::move(job));
  }
  const bool group = jobs.size() > 1;
  std::vector<int64_t> steps;
  for (const GroupJob& job : jobs) steps.push_back(job.spec.flux.steps);
  int status = 0;
  for (const GroupJobOutcome& out : RunFluxGroupTraining(std::move(jobs), options)) {
    if (out.error && !group) std::rethrow_exception(out.error);
    const std::string prefix = group ? out.name + ": " : "";
    if (out.error) {
      std::printf("%sfailed: %s\n", prefix.c_str(), FailureMessage(out.error).c_str());
      status = std::max(status, 1);
      continue;
    }
    status = std::max(status, PrintEnd(prefix, out.result, steps[out.index], out.result.final_loss,
                                       options.stop != nullptr ? options.stop->load() : 0));
  }
  std::fflush(stdout);
  return status;
}

}  // namespace lorastream::worker::flux
