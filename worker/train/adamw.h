// AdamW on the fp32 LoRA master weights, the exact arithmetic of torch.optim.AdamW
// (single-tensor path): decoupled weight decay, lerp for the first moment, bias corrections
// applied to the step size and to sqrt(v). Plus the learning-rate schedules and the global
// gradient-norm clipping of transformers / torch.nn.utils.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "worker/stream/stream_budget.h"

namespace lorastream::worker {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // The most bytes of the update's temporary (sqrt(v), one f32 per parameter) at once: the
  // parameters are updated in runs of at most this many bytes of it (one parameter larger
  // than that is a run of its own), so a large adapter (a mixture of experts': hundreds of
  // millions of parameters) needs no second copy of its size at the optimizer step. The
  // arithmetic per element is the same whatever the runs. The memory estimate counts it
  // (worker/stream/stream_budget.h).
  uint64_t scratch_bytes = kOptimizerScratchBytes;
};

class AdamW {
 public:
  AdamW(std::vector<at::Tensor> params, AdamWOptions options);
  // One update with each parameter's .grad() at learning rate `lr` (parameters without a
  // gradient are skipped, as torch does).
  void Step(double lr);
  void ZeroGrad();

  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }
  std::vector<at::Tensor>& exp_avg() { return exp_avg_; }
  std::vector<at::Tensor>& exp_avg_sq() { return exp_avg_sq_; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_;
  AdamWOptions options_;
  int64_t step_ = 0;
};

// The learning-rate multiplier of transformers' get_{constant,linear,cosine}_schedule_with_warmup
// at scheduler step `step` (0 for the first optimizer step).
double ScheduleFactor(const std::string& schedule, int64_t step, int64_t warmup_steps,
                      int64_t total_steps);

// torch.nn.utils.clip_grad_norm_: returns the global 2-norm before clipping, an f32 scalar on
// the gradients' device; when max_norm > 0 multiplies every gradient by
// min(1, max_norm / (norm + 1e-6)), that factor staying on the device as torch 2 keeps it. Nothing
// waits for the device: the step reads the norm with its loss, once (worker/train/trainer.cc).
// Undefined when no parameter has a gradient.
at::Tensor ClipGradNormAsync(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace lorastream::worker
