// The block's element-wise steps on tensors. Each has the ATen reference (LibTorch ops, the
// arithmetic transformers runs: every op rounds to the tensor's dtype) and, in a CUDA build,
// a fused kernel (worker/model/cuda/fused_kernels.h) that rounds at the same points and replaces
// five to ten memory-bound kernels by one. The fused kernel runs for CUDA tensors of f32,
// bf16 or f16 in the layout it expects; anything else takes the reference. Setting
// LORASTREAM_FUSED_KERNELS=0 in the environment makes every call take the reference (A/B
// timing, bisecting a numerical difference).
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace lorastream::worker {

// transformers' RMSNorm over the last dimension: in f32, weight * (x * rstd).to(x's dtype).
// `rstd` (optional) receives 1/rms, f32, x's shape with a last dimension of 1.
at::Tensor RmsNormRstd(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* rstd);
// Its input gradient for dy, from the saved input and rstd.
at::Tensor RmsNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd,
                           const at::Tensor& weight);

// silu(gate) * up, and its gradients (dgate, dup) for dz.
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);
std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& dz, const at::Tensor& gate,
                                                 const at::Tensor& up);

// Rotary embedding of x [B, h, S, D] with the step's tables cos, sin [>= S, D]:
// x * cos + rotate_half(x) * sin, and its backward g * cos + rotate_half^T(g * sin). Both
// return [B, h, S, D]; the fused backward lays its result out as [B, S, h, D] (what the
// projection's backward reads after transposing it back).
at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor RopeBackward(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin);

// Joint attention's heads (FLUX.1, Qwen-Image): the H heads of D of one stream's q, k or v,
// the columns [col, col + H D) of a projection's output `src` [B, L, W] (contiguous), into
// `out`, a [B, H, L, D] view (last dimension contiguous) of the stream's positions: with
// `scale` [D] (q and k) each head RMS-normed (eps 1e-6) as RmsNormRstd and rounded, then with
// `pe` (f32 [B or 1, 1, >= pos_offset + L, D / 2, 2, 2]) each pair (x[2j], x[2j+1]) rotated in f32
// by its table at position pos_offset + l (FLUX.1's apply_rope) and rounded once; with neither,
// copied. One kernel, one read and one write. Backward: from dy (out's gradient, a [B, H, L, D]
// view) into the same columns of `dsrc` (src's shape and strides), from src read again. Both return
// false, writing nothing, where the kernel does not apply (fused kernels off, not CUDA, dtypes that
// differ or are not f32/bf16/f16, D odd or above 256, a layout other than these); the caller then
// runs the ATen ops.
struct HeadsPart {
  at::Tensor src;
  int64_t col = 0;
  at::Tensor scale;  // undefined: v
};
// Whether the heads kernel runs on `device` for `dtype` and heads of head_dim at all (the
// planner's question: HeadsFusable further checks the tensors' layouts, which the models
// make as it wants them).
bool HeadsKernelApplies(c10::Device device, c10::ScalarType dtype, int64_t head_dim);
// Whether the kernel runs for `part` of heads of head_dim with pe at pos_offset (into a view
// of the right shape, its last dimension contiguous).
bool HeadsFusable(const HeadsPart& part, int64_t heads, int64_t head_dim, const at::Tensor& pe,
                  int64_t pos_offset);
bool FusedHeadsForward(const HeadsPart& part, int64_t heads, const at::Tensor& pe,
                       int64_t pos_offset, const at::Tensor& out);
bool FusedHeadsBackward(const HeadsPart& part, int64_t heads, const at::Tensor& pe,
                        int64_t pos_offset, const at::Tensor& dy, const at::Tensor& dsrc);

// The chunked LM head's cross entropy over one chunk: logits [rows, V] (contiguous, the
// compute dtype) against targets [rows] (int64 on the logits' device; -100: ignored).
// Returns the sum of the rows' losses, f32 scalar: log-softmax in f32 and the negative
// log-likelihood of each target. With `want_grad`, *logits becomes d(that sum)/d(logits),
// softmax - onehot on the rows with a target and 0 on the others, rounded to the logits'
// dtype: the fused kernel overwrites the logits in place (in bf16 and f16); the reference
// replaces them with a new tensor (their f32 copy and its log-softmax exist meanwhile).
at::Tensor CrossEntropySum(at::Tensor* logits, const at::Tensor& targets, bool want_grad);
// Whether CrossEntropySum runs the fused kernel for logits of `dtype` on a CUDA device
// (`cuda`): what the head's chunk size and the memory estimate count on.
bool FusedCrossEntropyApplies(bool cuda, c10::ScalarType dtype);

// The ATen references, always (tests compare the fused kernels against these).
namespace reference {
at::Tensor CrossEntropySum(at::Tensor* logits, const at::Tensor& targets, bool want_grad);
at::Tensor RmsNormRstd(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* rstd);
at::Tensor RmsNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd,
                           const at::Tensor& weight);
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);
std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& dz, const at::Tensor& gate,
                                                 const at::Tensor& up);
at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor RopeBackward(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin);
}  // namespace reference

// Whether the fused kernels may run (a CUDA build, LORASTREAM_FUSED_KERNELS not "0").
bool FusedKernelsEnabled();

}  // namespace lorastream::worker
