// FLUX.1's objective: rectified-flow matching as sd-scripts' flux_train_utils.py computes it
// (get_noisy_model_input_and_timesteps, model_prediction_type "raw"), shared with the other
// diffusion families (worker/model/flow_match.h).
#pragma once

#include "worker/model/flow_match.h"

namespace lorastream::worker::flux {

using dit::FlowLoss;
using dit::FlowMatch;
using dit::FluxShiftMu;
using dit::MakeFlowMatch;
using dit::SampleTimesteps;
using dit::TimestepSampling;

}  // namespace lorastream::worker::flux
