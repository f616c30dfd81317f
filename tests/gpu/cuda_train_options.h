// The trainer's options of the CUDA tests: cuda:0, from scratch; with `streamed`, the streaming
// engine as the provider (the job's [stream] plan), as lorastream-worker train runs it.
#pragma once

#include <string>

#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"

namespace lorastream::testing {

inline worker::TrainOptions CudaTrainOptions(bool streamed) {
  worker::TrainOptions o;
  o.device = "cuda:0";
  o.resume = false;
  if (streamed)
    o.make_provider = [](const JobSpec& j, const worker::BaseWeights& b, const std::string& d,
                         const std::string& dt, const std::vector<JobSpec>& group) {
      return worker::MakeStreamProvider(j, b, d, dt, {}, group);
    };
  return o;
}

}  // namespace lorastream::testing
