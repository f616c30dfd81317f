#include "worker/train/adamw.h"

#include <cmath>
#include <cstddef>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include "common/base/error.h"

namespace lorastream::worker {

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions options)
    : params_(std::move(params)), options_(options) {
  for (const auto& p : params_) {
    exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve).detach());
    exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve).detach());
  }
}

void AdamW::ZeroGrad() {
  for (auto& p : params_) {
    // set_to_none, as torch's default: the next backward writes fresh gradients.
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
  }
}

void AdamW::Step(double lr) {
  c10::NoGradGuard no_grad;
  ++step_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bias_correction1 = 1 - std::pow(b1, static_cast<double>(step_));
  const double bias_correction2 = 1 - std::pow(b2, static_cast<double>(step_));
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    params.push_back(params_[i]);
    grads.push_back(params_[i].grad());
    exp_avg.push_back(exp_avg_[i]);
    exp_avg_sq.push_back(exp_avg_sq_[i]);
  }
  if (params.empty()) return;
  // torch's multi-tensor ("foreach") AdamW: the same arithmetic per element as the
  // single-tensor path, in a few fused launches instead of ~8 per tensor (a model of 224
  // LoRA tensors would otherwise spend milliseconds per step launching kernels on a GPU),
  // over runs of parameters whose sqrt(v) temporaries fit options_.scratch_bytes.
  const double decay = 1 - lr * options_.weight_decay;
  size_t begin = 0;
  while (begin < params.size()) {
    size_t end = begin;
    uint64_t bytes = 0;
    do {
      bytes += static_cast<uint64_t>(exp_avg_sq[end].numel()) * exp_avg_sq[end].element_size();
      ++end;
    } while (end < params.size() && bytes + static_cast<uint64_t>(exp_avg_sq[end].numel()) *
                                                exp_avg_sq[end].element_size() <=
                                        options_.scratch_bytes);
    const auto run = [&](const std::vector<at::Tensor>& v) {
      return std::vector<at::Tensor>(v.begin() + static_cast<std::ptrdiff_t>(begin),
                                     v.begin() + static_cast<std::ptrdiff_t>(end));
    };
    std::vector<at::Tensor> p = run(params), g = run(grads), m = run(exp_avg), v = run(exp_avg_sq);
    at::_foreach_mul_(p, decay);
#if TORCH_VERSION_MAJOR >= 2
    at::_foreach_lerp_(m, g, 1 - b1);
#else
    for (size_t i = 0; i < m.size(); ++i) m[i].lerp_(g[i], 1 - b1);
#endif
    at::_foreach_mul_(v, b2);
    at::_foreach_addcmul_(v, g, g, 1 - b2);
    std::vector<at::Tensor> denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, bias_correction2_sqrt);
    at::_foreach_add_(denom, options_.eps);
    at::_foreach_addcdiv_(p, m, denom, -step_size);
    begin = end;
  }
}

double ScheduleFactor(const std::string& schedule, int64_t step, int64_t warmup, int64_t total) {
  if (step < warmup)
    return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
  if (schedule == "constant") return 1.0;
  if (schedule == "linear")
    return std::max(0.0, static_cast<double>(total - step) /
                             static_cast<double>(std::max<int64_t>(1, total - warmup)));
  if (schedule == "cosine") {
    const double progress = static_cast<double>(step - warmup) /
                            static_cast<double>(std::max<int64_t>(1, total - warmup));
    return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * 0.5 * 2.0 * progress)));
  }
  throw Error(ErrorCode::kRefused, "optim.schedule: unknown schedule `" + schedule + "`");
}

at::Tensor ClipGradNormAsync(const std::vector<at::Tensor>& params, double max_norm) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return at::Tensor();
  std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2.0);
  at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2.0);
  if (max_norm > 0) {
    // torch: max_norm / (norm + 1e-6), which Python evaluates as reciprocal() * max_norm,
    // clamped to 1, in f32, and multiplied into the gradients as a tensor: no host read.
    at::Tensor coef = at::clamp_max(at::reciprocal(total + 1e-6) * max_norm, 1.0);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
    at::_foreach_mul_(grads, coef);
#else
    for (auto& g : grads) g.mul_(coef);  // LibTorch < 2.1 has no foreach multiply by a tensor
#endif
  }
  return total;
}

}  // namespace lorastream::worker
