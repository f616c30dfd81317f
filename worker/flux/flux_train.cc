#include "worker/flux/flux_train.h"

#include "common/job/job_spec.h"
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
  GroupTrainer group(one.spec, options);
  group.Add(std::move(one));
  group.Run();
  const GroupJobOutcome out = group.TakeLeft().at(0);
  if (out.error) std::rethrow_exception(out.error);
  result.first_step = out.result.start_step;
  result.checkpoint_dir = out.result.checkpoint_dir;
  result.graphed_steps = out.result.graphed_micro_batches;
  if (!result.steps.empty() && !out.result.adapter_dir.empty()) {
    result.kohya_path = out.result.adapter_dir + "/" + kKohyaAdapterFile;
    result.diffusers_path = out.result.adapter_dir + "/" + kDiffusersAdapterFile;
  }
  return result;
}

}  // namespace lorastream::worker::flux
