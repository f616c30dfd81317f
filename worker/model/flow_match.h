// Rectified-flow matching as the diffusion trainers compute it (sd-scripts' FLUX
// get_noisy_model_input_and_timesteps; musubi-tuner's, the same formulas, for Qwen-Image): a
// sigma t in (0, 1) per image, noisy = (1 - t) x + t noise, the model (given t, scaled by 1000
// inside) predicts noise - x, the loss is the mean squared error over every element.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace lorastream::worker::dit {

struct TimestepSampling {
  std::string method = "sigmoid";  // uniform | sigmoid | shift | flux_shift | qwen_shift
  double sigmoid_scale = 1.0;
  double discrete_flow_shift = 3.0;
};

// t [batch] (f32, CPU) drawn from `gen`:
//   uniform     t ~ U(0, 1)
//   sigmoid     t = sigmoid(scale * n), n ~ N(0, 1)
//   shift       t = sigmoid(scale * n), then s t / (1 + (s - 1) t), s = discrete_flow_shift
//   flux_shift  t = sigmoid(scale * n), then e^mu / (e^mu + 1/t - 1), mu linear in the image
//               tokens (latent_h / 2)(latent_w / 2): 0.5 at 256 tokens, 1.15 at 4096
//   qwen_shift  t = sigmoid(scale * n), then s t / (1 + (s - 1) t) with s = e^mu, mu linear in
//               the image tokens: 0.5 at 256, 0.9 at 8192 (musubi-tuner's qwen_shift)
at::Tensor SampleTimesteps(const TimestepSampling& s, int64_t batch, int64_t latent_h,
                           int64_t latent_w, at::Generator& gen);

// mu at `image_tokens` on the line through (x1, y1) and (x2, y2).
double ShiftMu(int64_t image_tokens, double x1, double y1, double x2, double y2);
// FLUX's resolution-dependent shift mu, and Qwen-Image's (musubi-tuner's qwen_shift).
double FluxShiftMu(int64_t image_tokens);
double QwenShiftMu(int64_t image_tokens);

struct FlowMatch {
  at::Tensor noisy;   // (1 - t) x + t noise
  at::Tensor target;  // noise - x
};
// x, noise [B, ...]; t [B].
FlowMatch MakeFlowMatch(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& t);

// A step's noised latents [B, C, h, w]: noise ~ N(0, 1) and t (SampleTimesteps) from one
// generator seeded by the job's seed and the step alone.
struct NoisedStep {
  at::Tensor t;
  FlowMatch fm;
};
NoisedStep NoiseForStep(const at::Tensor& latents, uint64_t seed, int64_t step,
                        const TimestepSampling& sampling);

// mean((pred - target)^2) in f32 (f64 for an f64 model).
at::Tensor FlowLoss(const at::Tensor& pred, const at::Tensor& target);
// A group step's end: each job's FlowLoss, one backward over them all (each loss's gradient 1,
// as its own backward would seed it), and per job its loss (detached).
std::vector<at::Tensor> FlowLossesBackward(const std::vector<at::Tensor>& predictions,
                                           const std::vector<const at::Tensor*>& targets);

}  // namespace lorastream::worker::dit
