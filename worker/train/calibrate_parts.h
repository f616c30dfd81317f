// What the families' calibrations measure alike, on the job's device as the trainer runs it:
// a diffusion transformer's unit (FLUX.1's, Qwen-Image's): its forward without grad, and its
// recompute with grad and its backward (the gradients of its streams and its LoRA weights), a
// few repetitions each after a warm-up; and every family's optimizer step with its clipping
// over an adapter. Seconds (on a GPU: the device's, synchronised).
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace lorastream::worker {

struct UnitSeconds {
  double forward = 0;   // without grad
  double backward = 0;  // recomputed with grad and its backward
};

// `forward` maps the unit's input streams to its output streams; `params` are its LoRA
// weights (the backward's other gradients). gpu: more repetitions.
UnitSeconds MeasureUnitSeconds(
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& forward,
    const std::vector<at::Tensor>& streams, const std::vector<at::Tensor>& params, bool gpu);

// The optimizer's step (AdamW with f32 or, `eight_bit`, 8-bit moments, gradients clipped to
// `max_grad_norm`) over `params`, whose gradients it sets for the measurement and drops after:
// the step's tail (every family's calibration measures it so).
double MeasureOptimizerSeconds(const std::vector<at::Tensor>& params, double max_grad_norm,
                               bool eight_bit, bool gpu);

}  // namespace lorastream::worker
