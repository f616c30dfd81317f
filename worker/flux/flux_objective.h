// Rectified-flow matching as the FLUX trainers compute it (sd-scripts' flux_train_utils.py
// get_noisy_model_input_and_timesteps, with model_prediction_type "raw"): a sigma t in (0, 1)
// per image, noisy = (1 - t) x + t noise, the model (given t, scaled by 1000 inside) predicts
// noise - x, the loss is the mean squared error over every element.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace lorastream::worker::flux {

struct TimestepSampling {
  std::string method = "sigmoid";  // uniform | sigmoid | shift | flux_shift
  double sigmoid_scale = 1.0;
  double discrete_flow_shift = 3.0;
};

// t [batch] (f32, CPU) drawn from `gen`:
//   uniform     t ~ U(0, 1)
//   sigmoid     t = sigmoid(scale * n), n ~ N(0, 1)
//   shift       t = sigmoid(scale * n), then s t / (1 + (s - 1) t), s = discrete_flow_shift
//   flux_shift  t = sigmoid(scale * n), then e^mu / (e^mu + 1/t - 1), mu linear in the image
//               tokens (latent_h / 2)(latent_w / 2): 0.5 at 256 tokens, 1.15 at 4096
at::Tensor SampleTimesteps(const TimestepSampling& s, int64_t batch, int64_t latent_h,
                           int64_t latent_w, at::Generator& gen);

// FLUX's resolution-dependent shift mu for `image_tokens` tokens.
double FluxShiftMu(int64_t image_tokens);

struct FlowMatch {
  at::Tensor noisy;   // (1 - t) x + t noise
  at::Tensor target;  // noise - x
};
// x, noise [B, ...]; t [B].
FlowMatch MakeFlowMatch(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& t);

// mean((pred - target)^2) in f32 (f64 for an f64 model).
at::Tensor FlowLoss(const at::Tensor& pred, const at::Tensor& target);

}  // namespace lorastream::worker::flux
