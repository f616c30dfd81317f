// The final norm, LM head and cross entropy in chunks of rows, as one custom autograd
// function (as worker/model/checkpointed_block.cc is for a block). Per chunk: logits = norm(h) W^T
// in the compute dtype, log-softmax and the loss in f32 (on CUDA in bf16/f16 one fused kernel
// that writes the gradient over the logits: worker/model/fused_ops.h); when a gradient is wanted,
// the chunk's (softmax - onehot), in the compute dtype, times W, back through the norm (a
// small local autograd graph over the chunk's rows only), written into the kept gradient of
// the hidden states. These are the operations autograd runs through the unchunked path
// (cross_entropy = nll_loss(log_softmax); log_softmax's backward of nll's -onehot is
// exp(log_softmax) - onehot; the cast's backward casts; linear's is grad W), so the two agree
// within f32 rounding. The backward only multiplies the kept gradient by the incoming one.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "worker/model/fused_ops.h"
#include "worker/model/lm_head.h"
#include "worker/model/model.h"

namespace lorastream::worker {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct HeadArgs {
  at::Tensor targets;  // [B x S] int64 on hidden's device
  at::Tensor norm;
  double eps = 0;
  HeadProvider* head = nullptr;
  int64_t chunk_rows = 0;
};

// The head's weights between Acquire and Release, released on every path out.
class AcquiredHead {
 public:
  explicit AcquiredHead(HeadProvider& head) : head_(head) { head.Acquire(); }
  ~AcquiredHead() {
    try {
      head_.Release();
    } catch (const std::exception& e) {
      LS_LOG_WARN("LM head: release failed: {}", e.what());
    }
  }
  AcquiredHead(const AcquiredHead&) = delete;
  AcquiredHead& operator=(const AcquiredHead&) = delete;

 private:
  HeadProvider& head_;
};

// The loss sum over the rows of `hidden` [N, H]; with `grad` non-null, also d(loss)/d(hidden)
// [N, H] in hidden's dtype.
at::Tensor LossInChunks(const at::Tensor& hidden, const HeadArgs& a, at::Tensor* grad) {
  const int64_t n = hidden.size(0);
  HeadProvider& head = *a.head;
  const AcquiredHead acquired(head);
  const int64_t slices = head.num_slices();
  const at::Tensor whole = slices == 1 ? head.Slice(0) : at::Tensor();
  at::Tensor loss = at::zeros({}, hidden.options().dtype(at::kFloat));
  if (grad != nullptr) *grad = at::empty_like(hidden);
  for (int64_t start = 0; start < n; start += a.chunk_rows) {
    const int64_t rows = std::min(a.chunk_rows, n - start);
    const at::Tensor t = a.targets.narrow(0, start, rows);
    at::Tensor x = hidden.narrow(0, start, rows).detach();
    at::Tensor normed;
    if (grad != nullptr) {
      c10::AutoGradMode enable_grad(true);
      x.requires_grad_(true);
      normed = RmsNorm(x, a.norm, a.eps);
    } else {
      normed = RmsNorm(x, a.norm, a.eps);
    }
    // The logits, slice by slice into the chunk's for a head of several (each slice's rows
    // its columns).
    at::Tensor logits;
    if (slices == 1) {
      logits = at::linear(normed.detach(), whole);
    } else {
      logits = at::empty({rows, head.vocab()}, normed.options());
      for (int64_t i = 0; i < slices; ++i) {
        const at::Tensor w = head.Slice(i);
        logits.narrow(1, i * head.slice_rows(), w.size(0)).copy_(at::linear(normed.detach(), w));
      }
    }
    // The loss, and in place of the logits their gradient (worker/model/fused_ops.h).
    loss.add_(CrossEntropySum(&logits, t, grad != nullptr));
    if (grad == nullptr) continue;
    at::Tensor grad_normed;
    if (slices == 1) {
      grad_normed = at::mm(logits, whole);
    } else {
      // The sum over the slices, accumulated in f32 and rounded once to the compute dtype.
      at::Tensor sum = at::zeros({rows, hidden.size(1)}, normed.options().dtype(at::kFloat));
      for (int64_t i = 0; i < slices; ++i) {
        const at::Tensor w = head.Slice(i);
        sum.add_(at::mm(logits.narrow(1, i * head.slice_rows(), w.size(0)), w));
      }
      grad_normed = sum.to(logits.scalar_type());
    }
    logits = at::Tensor();
    grad->narrow(0, start, rows)
        .copy_(torch::autograd::grad({normed}, {x}, {grad_normed}, /*retain_graph=*/false,
                                     /*create_graph=*/false)[0]);
  }
  return loss;
}

class GradHolder : public torch::CustomClassHolder {
 public:
  explicit GradHolder(at::Tensor g) : grad(std::move(g)) {}
  at::Tensor grad;
};

struct ChunkedHead : public torch::autograd::Function<ChunkedHead> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const HeadArgs* args) {
    const int64_t width = hidden.size(-1);
    at::Tensor grad;
    at::Tensor loss = LossInChunks(hidden.reshape({-1, width}), *args, &grad);
    // Kept as data, not as a saved variable: it is neither an input nor an output.
    ctx->saved_data["grad"] =
        c10::IValue::make_capsule(c10::make_intrusive<GradHolder>(grad.view(hidden.sizes())));
    return {loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto holder = ctx->saved_data["grad"].toCapsule();
    at::Tensor& grad = static_cast<GradHolder*>(holder.get())->grad;
    LS_CHECK(grad.defined(), "the chunked LM head's backward ran twice");
    // The incoming gradient is an f32 scalar; the product stays in hidden's dtype.
    at::Tensor result = grad * grad_out[0];
    grad = at::Tensor();  // the kept gradient is freed once used (no second backward)
    return {result, at::Tensor()};
  }
};

}  // namespace

at::Tensor ChunkedHeadLossSum(const at::Tensor& hidden, const at::Tensor& targets,
                              const at::Tensor& norm_weight, double eps, HeadProvider& head,
                              int64_t chunk_rows) {
  if (chunk_rows < 1)
    throw Error(ErrorCode::kInvalidArgument, "the LM head's chunk must hold at least one row");
  if (targets.numel() * hidden.size(-1) != hidden.numel())
    throw Error(ErrorCode::kInvalidArgument, "targets and hidden states differ in positions");
  HeadArgs args;
  args.targets = targets.reshape({-1}).to(hidden.device());
  args.norm = norm_weight;
  args.eps = eps;
  args.head = &head;
  args.chunk_rows = chunk_rows;
  if (!c10::GradMode::is_enabled() || !hidden.requires_grad()) {
    return LossInChunks(hidden.reshape({-1, hidden.size(-1)}), args, nullptr);
  }
  return ChunkedHead::apply(hidden, &args)[0];
}

}  // namespace lorastream::worker
