#include "worker/model/flow_match.h"

#include <cmath>

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "worker/model/model.h"

namespace lorastream::worker::dit {

double ShiftMu(int64_t image_tokens, double x1, double y1, double x2, double y2) {
  const double m = (y2 - y1) / (x2 - x1);
  return m * static_cast<double>(image_tokens) + (y1 - m * x1);
}

double FluxShiftMu(int64_t image_tokens) { return ShiftMu(image_tokens, 256, 0.5, 4096, 1.15); }

double QwenShiftMu(int64_t image_tokens) { return ShiftMu(image_tokens, 256, 0.5, 8192, 0.9); }

at::Tensor SampleTimesteps(const TimestepSampling& s, int64_t batch, int64_t latent_h,
                           int64_t latent_w, at::Generator& gen) {
  if (s.method == "uniform") return at::empty({batch}, at::kFloat).uniform_(0.0, 1.0, gen);
  const at::Tensor t =
      at::sigmoid(at::empty({batch}, at::kFloat).normal_(0.0, 1.0, gen) * s.sigmoid_scale);
  if (s.method == "sigmoid") return t;
  if (s.method == "shift" || s.method == "qwen_shift") {
    const double k = s.method == "shift" ? s.discrete_flow_shift
                                         : std::exp(QwenShiftMu((latent_h / 2) * (latent_w / 2)));
    return (t * k) / (1 + (k - 1) * t);
  }
  if (s.method == "flux_shift") {
    const double e = std::exp(FluxShiftMu((latent_h / 2) * (latent_w / 2)));
    return e / (e + (1.0 / t - 1.0));
  }
  throw Error(ErrorCode::kRefused, "timestep_sampling `" + s.method +
                                       "`: uniform, sigmoid, shift, flux_shift or qwen_shift");
}

FlowMatch MakeFlowMatch(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& t) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[0] = x.size(0);
  const at::Tensor tt = t.to(x.device(), x.scalar_type()).view(shape);
  return {(1 - tt) * x + tt * noise, noise - x};
}

NoisedStep NoiseForStep(const at::Tensor& latents, uint64_t seed, int64_t step,
                        const TimestepSampling& sampling) {
  at::Generator gen = at::detail::createCPUGenerator(MixSeed(seed, 0x5eed, step));
  const at::Tensor noise = at::empty(latents.sizes(), at::kFloat).normal_(0.0, 1.0, gen);
  NoisedStep out;
  out.t = SampleTimesteps(sampling, latents.size(0), latents.size(2), latents.size(3), gen);
  out.fm = MakeFlowMatch(latents, noise, out.t);
  return out;
}

at::Tensor FlowLoss(const at::Tensor& pred, const at::Tensor& target) {
  const auto type = pred.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // f64 tests
  return (pred.to(type) - target.to(type)).pow(2).mean();
}

std::vector<at::Tensor> FlowLossesBackward(const std::vector<at::Tensor>& predictions,
                                           const std::vector<const at::Tensor*>& targets) {
  std::vector<at::Tensor> losses;
  for (size_t j = 0; j < predictions.size(); ++j)
    losses.push_back(FlowLoss(predictions[j], *targets[j]));
  torch::autograd::backward(losses);
  for (at::Tensor& loss : losses) loss = loss.detach();
  return losses;
}

}  // namespace lorastream::worker::dit
