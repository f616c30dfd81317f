#include "worker/model/fused_ops.h"

#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <c10/core/GradMode.h>

#include "common/formats/data.h"

#if LORASTREAM_HAVE_CUDA
#include <c10/cuda/CUDAStream.h>

#include "worker/model/cuda/fused_kernels.h"
#endif

namespace lorastream::worker {

namespace reference {

at::Tensor RmsNormRstd(const at::Tensor& x, const at::Tensor& weight, double eps,
                       at::Tensor* rstd) {
  const auto input_dtype = x.scalar_type();
  at::Tensor h = x.to(at::kFloat);
  at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (rstd) *rstd = r;
  return weight * (h * r).to(input_dtype);
}

at::Tensor RmsNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd,
                           const at::Tensor& weight) {
  // y = w * n.to(dt), n = h * rstd, rstd = (mean(h^2) + eps)^-1/2:
  // dh = rstd * (dn - n * mean(dn * n)), with dn = (dy * w) in f32.
  at::Tensor dn = (dy * weight).to(at::kFloat);
  at::Tensor n = x.to(at::kFloat) * rstd;
  at::Tensor dh = (dn - n * (dn * n).mean(-1, /*keepdim=*/true)) * rstd;
  return dh.to(x.scalar_type());
}

at::Tensor CrossEntropySum(at::Tensor* logits, const at::Tensor& targets, bool want_grad) {
  const c10::ScalarType dtype = logits->scalar_type();
  // The compute-dtype logits are dropped once their f32 copy exists.
  at::Tensor logp = at::log_softmax(logits->to(at::kFloat), 1);
  *logits = at::Tensor();
  at::Tensor loss = at::nll_loss(logp, targets, /*weight=*/{}, at::Reduction::Sum, kIgnoreIndex);
  if (want_grad) {
    // d(sum of -logp[target]) / d(logits) = softmax - onehot on the rows with a target, 0 on
    // ignored rows; in place over logp (cross_entropy = nll_loss(log_softmax); log_softmax's
    // backward of nll's -onehot is exp(log_softmax) - onehot).
    const at::Tensor valid = targets.ne(kIgnoreIndex);
    at::Tensor g = logp.exp_();
    g.scatter_add_(1, targets.clamp_min(0).unsqueeze(1), valid.to(at::kFloat).neg().unsqueeze(1));
    g.mul_(valid.unsqueeze(1));
    *logits = g.to(dtype);
  }
  return loss;
}

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) { return at::silu(gate) * up; }

std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& dz, const at::Tensor& gate,
                                                 const at::Tensor& up) {
  return {at::silu_backward(dz * up, gate), dz * at::silu(gate)};
}

namespace {
// transformers' rotate_half (x1, x2) -> (-x2, x1) and its transpose (y1, y2) -> (y2, -y1).
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
at::Tensor RotateHalfTransposed(const at::Tensor& y) {
  const int64_t half = y.size(-1) / 2;
  return at::cat({y.narrow(-1, half, half), -y.narrow(-1, 0, half)}, -1);
}
}  // namespace

at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + RotateHalf(x) * sin;
}

at::Tensor RopeBackward(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin) {
  return g * cos + RotateHalfTransposed(g * sin);
}

}  // namespace reference

bool FusedKernelsEnabled() {
#if LORASTREAM_HAVE_CUDA
  static const bool enabled = [] {
    const char* v = std::getenv("LORASTREAM_FUSED_KERNELS");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return enabled;
#else
  return false;
#endif
}

#if LORASTREAM_HAVE_CUDA
namespace {

bool KernelDtypeOf(c10::ScalarType s, cuda::KernelDtype* t) {
  switch (s) {
    case at::kFloat:
      *t = cuda::KernelDtype::kF32;
      return true;
    case at::kBFloat16:
      *t = cuda::KernelDtype::kBF16;
      return true;
    case at::kHalf:
      *t = cuda::KernelDtype::kF16;
      return true;
    default:
      return false;
  }
}

// Whether the fused kernel applies: CUDA tensors of one supported dtype, contiguous, and no
// gradient to record (the kernels are invisible to autograd: where autograd differentiates
// through them, as in the final norm and the reference forward, the ATen ops run).
bool Fusable(std::initializer_list<const at::Tensor*> dense, cuda::KernelDtype* t) {
  if (!FusedKernelsEnabled()) return false;
  const at::Tensor& first = **dense.begin();
  if (!first.is_cuda() || !KernelDtypeOf(first.scalar_type(), t)) return false;
  const bool recording = at::GradMode::is_enabled();
  for (const at::Tensor* x : dense)
    if (x->device() != first.device() || x->scalar_type() != first.scalar_type() ||
        !x->is_contiguous() || (recording && x->requires_grad()))
      return false;
  return true;
}

cudaStream_t StreamOf(const at::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
}

}  // namespace
#endif

at::Tensor RmsNormRstd(const at::Tensor& x, const at::Tensor& weight, double eps,
                       at::Tensor* rstd) {
#if LORASTREAM_HAVE_CUDA
  cuda::KernelDtype t;
  if (x.dim() >= 1 && Fusable({&x, &weight}, &t) && weight.numel() == x.size(-1)) {
    const int64_t cols = x.size(-1), rows = x.numel() / std::max<int64_t>(cols, 1);
    at::Tensor y = at::empty_like(x);
    std::vector<int64_t> rshape = x.sizes().vec();
    rshape.back() = 1;
    at::Tensor r = at::empty(rshape, x.options().dtype(at::kFloat));
    cuda::RmsNormForward(t, x.data_ptr(), weight.data_ptr(), y.data_ptr(), r.data_ptr<float>(),
                         rows, cols, static_cast<float>(eps), StreamOf(x));
    if (rstd) *rstd = r;
    return y;
  }
#endif
  return reference::RmsNormRstd(x, weight, eps, rstd);
}

at::Tensor RmsNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd,
                           const at::Tensor& weight) {
#if LORASTREAM_HAVE_CUDA
  cuda::KernelDtype t;
  if (x.dim() >= 1 && Fusable({&x, &dy, &weight}, &t) && dy.sizes() == x.sizes() &&
      rstd.scalar_type() == at::kFloat && rstd.is_contiguous() &&
      rstd.numel() * x.size(-1) == x.numel()) {
    const int64_t cols = x.size(-1), rows = rstd.numel();
    at::Tensor dx = at::empty_like(x);
    cuda::RmsNormBackward(t, dy.data_ptr(), x.data_ptr(), rstd.data_ptr<float>(), weight.data_ptr(),
                          dx.data_ptr(), rows, cols, StreamOf(x));
    return dx;
  }
#endif
  return reference::RmsNormBackward(dy, x, rstd, weight);
}

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) {
#if LORASTREAM_HAVE_CUDA
  cuda::KernelDtype t;
  if (Fusable({&gate, &up}, &t) && gate.sizes() == up.sizes()) {
    at::Tensor z = at::empty_like(gate);
    cuda::SwiGluForward(t, gate.data_ptr(), up.data_ptr(), z.data_ptr(), gate.numel(),
                        StreamOf(gate));
    return z;
  }
#endif
  return reference::SwiGlu(gate, up);
}

std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& dz, const at::Tensor& gate,
                                                 const at::Tensor& up) {
#if LORASTREAM_HAVE_CUDA
  cuda::KernelDtype t;
  if (Fusable({&dz, &gate, &up}, &t) && gate.sizes() == up.sizes() && dz.sizes() == gate.sizes()) {
    at::Tensor dgate = at::empty_like(gate), dup = at::empty_like(gate);
    cuda::SwiGluBackward(t, dz.data_ptr(), gate.data_ptr(), up.data_ptr(), dgate.data_ptr(),
                         dup.data_ptr(), gate.numel(), StreamOf(gate));
    return {dgate, dup};
  }
#endif
  return reference::SwiGluBackward(dz, gate, up);
}

bool FusedCrossEntropyApplies(bool cuda, c10::ScalarType dtype) {
  return cuda && FusedKernelsEnabled() && (dtype == at::kBFloat16 || dtype == at::kHalf);
}

at::Tensor CrossEntropySum(at::Tensor* logits, const at::Tensor& targets, bool want_grad) {
#if LORASTREAM_HAVE_CUDA
  // In bf16 and f16 only (FusedCrossEntropyApplies): f32 compute is what parity with
  // transformers is checked in, and there the reference's op order is transformers' own.
  cuda::KernelDtype t;
  if (FusedCrossEntropyApplies(logits->is_cuda(), logits->scalar_type()) && logits->dim() == 2 &&
      Fusable({logits}, &t) && targets.is_cuda() && targets.device() == logits->device() &&
      targets.scalar_type() == at::kLong && targets.is_contiguous() && targets.dim() == 1 &&
      targets.size(0) == logits->size(0)) {
    const int64_t rows = logits->size(0);
    at::Tensor row_loss = at::empty({rows}, logits->options().dtype(at::kFloat));
    cuda::CrossEntropyRows(t, logits->data_ptr(), targets.data_ptr<int64_t>(),
                           row_loss.data_ptr<float>(), rows, logits->size(1), want_grad,
                           StreamOf(*logits));
    if (!want_grad) *logits = at::Tensor();
    return row_loss.sum();
  }
#endif
  return reference::CrossEntropySum(logits, targets, want_grad);
}

#if LORASTREAM_HAVE_CUDA
namespace {

// The fused rotary kernel over x [B, h, S, D] (last dimension contiguous) into `out`.
bool FusedRope(bool backward, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
               at::Tensor& out) {
  cuda::KernelDtype t;
  if (x.dim() != 4 || x.stride(3) != 1 || x.size(3) % 2 != 0 ||
      (at::GradMode::is_enabled() && x.requires_grad()) || !Fusable({&cos, &sin}, &t) ||
      !x.is_cuda() || x.device() != cos.device() || x.scalar_type() != cos.scalar_type() ||
      cos.dim() != 2 || cos.size(0) < x.size(2) || cos.size(1) != x.size(3) ||
      sin.sizes() != cos.sizes())
    return false;
  const int64_t b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  // Forward: contiguous [B, h, S, D] (what attention reads best). Backward: laid out as
  // [B, S, h, D], the projection's layout.
  out = backward ? at::empty({b, s, h, d}, x.options()).transpose(1, 2)
                 : at::empty({b, h, s, d}, x.options());
  cuda::RopeShape shape{b,
                        h,
                        s,
                        d,
                        {x.stride(0), x.stride(1), x.stride(2)},
                        {out.stride(0), out.stride(1), out.stride(2)}};
  cuda::Rope(t, backward, x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), shape,
             StreamOf(x));
  return true;
}

}  // namespace
#endif

bool HeadsKernelApplies(c10::Device device, c10::ScalarType dtype, int64_t head_dim) {
#if LORASTREAM_HAVE_CUDA
  cuda::KernelDtype t;
  return FusedKernelsEnabled() && device.is_cuda() && KernelDtypeOf(dtype, &t) &&
         head_dim % 2 == 0 && head_dim >= 2 && head_dim <= 256;
#else
  (void)device, (void)dtype, (void)head_dim;
  return false;
#endif
}

bool HeadsFusable(const HeadsPart& part, int64_t heads, int64_t head_dim, const at::Tensor& pe,
                  int64_t pos_offset) {
#if LORASTREAM_HAVE_CUDA
  const at::Tensor& src = part.src;
  if (!src.defined() || !HeadsKernelApplies(src.device(), src.scalar_type(), head_dim) ||
      src.dim() != 3 || !src.is_contiguous() || heads < 1 || part.col < 0 ||
      part.col + heads * head_dim > src.size(2))
    return false;
  if (part.scale.defined() &&
      (part.scale.device() != src.device() || part.scale.scalar_type() != src.scalar_type() ||
       !part.scale.is_contiguous() || part.scale.numel() != head_dim))
    return false;
  return !pe.defined() ||
         (pe.device() == src.device() && pe.scalar_type() == at::kFloat && pe.is_contiguous() &&
          pe.dim() == 6 && (pe.size(0) == 1 || pe.size(0) == src.size(0)) && pe.size(1) == 1 &&
          pe.size(2) >= pos_offset + src.size(1) && pe.size(3) == head_dim / 2 && pe.size(4) == 2 &&
          pe.size(5) == 2);
#else
  (void)part, (void)heads, (void)head_dim, (void)pe, (void)pos_offset;
  return false;
#endif
}

#if LORASTREAM_HAVE_CUDA
namespace {

// The kernel's shape for `part` into (or from) `view`, a [B, H, L, D] view; false where the
// kernel does not apply to them.
bool HeadsShapeOf(const HeadsPart& part, int64_t heads, const at::Tensor& pe, int64_t pos_offset,
                  const at::Tensor& view, cuda::KernelDtype* t, cuda::HeadsShape* shape) {
  const at::Tensor& src = part.src;
  if (view.dim() != 4 || !HeadsFusable(part, heads, view.size(3), pe, pos_offset) ||
      !KernelDtypeOf(src.scalar_type(), t) || view.stride(3) != 1 ||
      view.device() != src.device() || view.scalar_type() != src.scalar_type() ||
      view.size(0) != src.size(0) || view.size(1) != heads || view.size(2) != src.size(1))
    return false;
  *shape = cuda::HeadsShape{src.size(0),
                            src.size(1),
                            heads,
                            view.size(3),
                            {src.stride(0), src.stride(1)},
                            {view.stride(0), view.stride(1), view.stride(2)},
                            pos_offset,
                            pe.defined() && pe.size(0) != 1 ? pe.stride(0) : 0};
  return true;
}

}  // namespace
#endif

bool FusedHeadsForward(const HeadsPart& part, int64_t heads, const at::Tensor& pe,
                       int64_t pos_offset, const at::Tensor& out) {
#if LORASTREAM_HAVE_CUDA
  cuda::KernelDtype t;
  cuda::HeadsShape shape;
  if (!HeadsShapeOf(part, heads, pe, pos_offset, out, &t, &shape)) return false;
  const char* src = static_cast<const char*>(part.src.data_ptr()) +
                    part.col * static_cast<int64_t>(part.src.element_size());
  cuda::HeadsForward(t, src, part.scale.defined() ? part.scale.data_ptr() : nullptr,
                     pe.defined() ? pe.data_ptr<float>() : nullptr, out.data_ptr(), shape, 1e-6f,
                     StreamOf(out));
  return true;
#else
  (void)part, (void)heads, (void)pe, (void)pos_offset, (void)out;
  return false;
#endif
}

bool FusedHeadsBackward(const HeadsPart& part, int64_t heads, const at::Tensor& pe,
                        int64_t pos_offset, const at::Tensor& dy, const at::Tensor& dsrc) {
#if LORASTREAM_HAVE_CUDA
  cuda::KernelDtype t;
  cuda::HeadsShape shape;
  if (!HeadsShapeOf(part, heads, pe, pos_offset, dy, &t, &shape) ||
      !dsrc.sizes().equals(part.src.sizes()) || !dsrc.strides().equals(part.src.strides()) ||
      dsrc.scalar_type() != part.src.scalar_type() || dsrc.device() != part.src.device())
    return false;
  const int64_t offset = part.col * static_cast<int64_t>(part.src.element_size());
  cuda::HeadsBackward(t, dy.data_ptr(), static_cast<const char*>(part.src.data_ptr()) + offset,
                      part.scale.defined() ? part.scale.data_ptr() : nullptr,
                      pe.defined() ? pe.data_ptr<float>() : nullptr,
                      static_cast<char*>(dsrc.data_ptr()) + offset, shape, 1e-6f, StreamOf(dy));
  return true;
#else
  (void)part, (void)heads, (void)pe, (void)pos_offset, (void)dy, (void)dsrc;
  return false;
#endif
}

at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
#if LORASTREAM_HAVE_CUDA
  at::Tensor out;
  if (FusedRope(false, x, cos, sin, out)) return out;
#endif
  return reference::RopeForward(x, cos.narrow(0, 0, x.size(2)), sin.narrow(0, 0, x.size(2)));
}

at::Tensor RopeBackward(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin) {
#if LORASTREAM_HAVE_CUDA
  at::Tensor out;
  if (FusedRope(true, g, cos, sin, out)) return out;
#endif
  return reference::RopeBackward(g, cos.narrow(0, 0, g.size(2)), sin.narrow(0, 0, g.size(2)));
}

}  // namespace lorastream::worker
