#include "worker/adamw.h"

#include <cmath>

#include <ATen/ATen.h>

#include "common/error.h"

namespace lorastream {

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
  at::NoGradGuard no_grad;
  ++step_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bias_correction1 = 1 - std::pow(b1, static_cast<double>(step_));
  const double bias_correction2 = 1 - std::pow(b2, static_cast<double>(step_));
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i];
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    p.mul_(1 - lr * options_.weight_decay);
    exp_avg_[i].lerp_(grad, 1 - b1);
    exp_avg_sq_[i].mul_(b2).addcmul_(grad, grad, 1 - b2);
    at::Tensor denom = (exp_avg_sq_[i].sqrt() / bias_correction2_sqrt).add_(options_.eps);
    p.addcdiv_(exp_avg_[i], denom, -step_size);
  }
}

double ScheduleFactor(const std::string& schedule, int64_t step, int64_t warmup,
                      int64_t total) {
  if (step < warmup) return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
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

double ClipGradNorm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(at::linalg_vector_norm(p.grad(), 2.0));
  if (norms.empty()) return 0.0;
  at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2.0);
  if (max_norm > 0) {
    // torch: max_norm / (norm + 1e-6), which Python evaluates as reciprocal() * max_norm.
    at::Tensor coef = at::clamp_max(at::reciprocal(total + 1e-6) * max_norm, 1.0);
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(coef.to(p.grad().device()));
  }
  return total.item<double>();
}

}  // namespace lorastream
