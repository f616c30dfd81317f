#include "worker/train/calibrate_parts.h"

#include <chrono>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "worker/train/adamw.h"

namespace lorastream::worker {

namespace {

using Clock = std::chrono::steady_clock;

// Waits for the device's work on `t` (a scalar read syncs the current stream).
void WaitFor(const at::Tensor& t) { (void)t.sum().item<double>(); }

// Seconds per run of `fn` (which returns a tensor computed by the run), after `warmup` runs,
// over `reps` runs.
template <class Fn>
double SecondsPerRun(int warmup, int reps, Fn fn) {
  for (int i = 0; i < warmup; ++i) WaitFor(fn());
  const auto start = Clock::now();
  at::Tensor last;
  for (int i = 0; i < reps; ++i) last = fn();
  WaitFor(last);
  return std::chrono::duration<double>(Clock::now() - start).count() / reps;
}

}  // namespace

UnitSeconds MeasureUnitSeconds(
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& forward,
    const std::vector<at::Tensor>& streams, const std::vector<at::Tensor>& params, bool gpu) {
  const int warmup = gpu ? 3 : 1, reps = gpu ? 5 : 2;
  UnitSeconds out;
  out.forward = SecondsPerRun(warmup, reps, [&] {
    c10::NoGradGuard no_grad;
    return forward(streams)[0];
  });
  out.backward = SecondsPerRun(warmup, reps, [&] {
    at::AutoGradMode grad_on(true);
    std::vector<at::Tensor> s, wrt;
    for (const auto& t : streams) s.push_back(t.detach().requires_grad_(true));
    wrt = s;
    for (const auto& p : params) wrt.push_back(p);
    const std::vector<at::Tensor> out_streams = forward(s);
    std::vector<at::Tensor> grads_out;
    for (const auto& o : out_streams) grads_out.push_back(at::ones_like(o));
    return torch::autograd::grad(out_streams, wrt, grads_out, false, false, true)[0];
  });
  return out;
}

double MeasureOptimizerSeconds(const std::vector<at::Tensor>& params, double max_grad_norm,
                               bool eight_bit, bool gpu) {
  if (params.empty()) return 0.0;  // nothing to step
  AdamWOptions options;
  options.eight_bit = eight_bit;
  AdamW optimizer(params, options);
  for (auto p : params) p.mutable_grad() = at::ones_like(p);
  const double seconds = SecondsPerRun(1, gpu ? 5 : 2, [&] {
    const at::Tensor norm = ClipGradNormAsync(params, max_grad_norm);
    optimizer.Step(1e-12);
    return norm;
  });
  // The gradients go with the optimizer's state: the calibration's next measurements have
  // the device's memory as before.
  for (auto p : params) p.mutable_grad() = at::Tensor();
  return seconds;
}

}  // namespace lorastream::worker
