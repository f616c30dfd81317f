#include "worker/flux/flux_objective.h"

#include <cmath>

#include <ATen/ATen.h>

#include "common/error.h"

namespace lorastream::worker::flux {

double FluxShiftMu(int64_t image_tokens) {
  const double m = (1.15 - 0.5) / (4096.0 - 256.0);
  return m * static_cast<double>(image_tokens) + (0.5 - m * 256.0);
}

at::Tensor SampleTimesteps(const TimestepSampling& s, int64_t batch, int64_t latent_h,
                           int64_t latent_w, at::Generator& gen) {
  if (s.method == "uniform") return at::empty({batch}, at::kFloat).uniform_(0.0, 1.0, gen);
  const at::Tensor t =
      at::sigmoid(at::empty({batch}, at::kFloat).normal_(0.0, 1.0, gen) * s.sigmoid_scale);
  if (s.method == "sigmoid") return t;
  if (s.method == "shift") {
    const double k = s.discrete_flow_shift;
    return (t * k) / (1 + (k - 1) * t);
  }
  if (s.method == "flux_shift") {
    const double e = std::exp(FluxShiftMu((latent_h / 2) * (latent_w / 2)));
    return e / (e + (1.0 / t - 1.0));
  }
  throw Error(ErrorCode::kRefused,
              "timestep_sampling `" + s.method + "`: uniform, sigmoid, shift or flux_shift");
}

FlowMatch MakeFlowMatch(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& t) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[0] = x.size(0);
  const at::Tensor tt = t.to(x.device(), x.scalar_type()).view(shape);
  return {(1 - tt) * x + tt * noise, noise - x};
}

at::Tensor FlowLoss(const at::Tensor& pred, const at::Tensor& target) {
  const auto type = pred.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // f64 tests
  return (pred.to(type) - target.to(type)).pow(2).mean();
}

}  // namespace lorastream::worker::flux
