// Fused element-wise kernels of the transformer block (worker/model/cuda/fused_kernels.cu), on raw
// device pointers: no LibTorch in the CUDA translation unit. worker/model/fused_ops.h wraps them
// for tensors and keeps the ATen reference path each one must agree with; every kernel
// rounds where that reference rounds (each ATen op rounds its result to the tensor's dtype)
// so the two differ only where f32 reductions sum in another order.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace lorastream::worker::cuda {

enum class KernelDtype { kF32, kBF16, kF16 };

// y[r, :] = w * (x[r, :] * rstd[r]).to(T), rstd[r] = 1 / sqrt(mean(x[r, :]^2) + eps) in f32.
// x, y: [rows, cols] contiguous; rstd: f32 [rows].
void RmsNormForward(KernelDtype t, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                    int64_t cols, float eps, cudaStream_t stream);
// dx = rstd * (dn - n * mean(dn * n)), dn = (dy * w).to(T) in f32, n = x * rstd.
void RmsNormBackward(KernelDtype t, const void* dy, const void* x, const float* rstd, const void* w,
                     void* dx, int64_t rows, int64_t cols, cudaStream_t stream);

// z = silu(gate) * up, n elements.
void SwiGluForward(KernelDtype t, const void* gate, const void* up, void* z, int64_t n,
                   cudaStream_t stream);
// dgate = silu'(gate) * (dz * up), dup = dz * silu(gate); dup may alias dz.
void SwiGluBackward(KernelDtype t, const void* dz, const void* gate, const void* up, void* dgate,
                    void* dup, int64_t n, cudaStream_t stream);

// Rotary embedding over [B, H, S, D] with D even: out = x * cos + rotate_half(x) * sin
// (backward: g * cos + rotate_half^T(g * sin)). The input is read through its strides (in
// elements; the last dimension contiguous), the output written through its own strides;
// cos and sin are contiguous [>= S, D].
struct RopeShape {
  int64_t batch, heads, seq, dim;
  int64_t in_stride[3];   // of dimensions B, H, S
  int64_t out_stride[3];  // of dimensions B, H, S
};
void Rope(KernelDtype t, bool backward, const void* in, void* out, const void* cos, const void* sin,
          const RopeShape& shape, cudaStream_t stream);

// The heads of one stream's q, k or v for joint attention (FLUX.1, Qwen-Image), one warp per
// (batch, position, head) row of D: read from a projection's output (rows of [B, L, W], the
// head h at column h D of `src`, which points at the part's first column), written through
// the output's strides. With `scale` (q and k) the row is RMS-normed in f32 and rounded,
// y = (scale * (x * rstd).to(T)).to(T), rstd = 1 / sqrt(mean(x^2) + eps), as RmsNormForward;
// with `pe` each pair (x[2j], x[2j+1]) then rotated by its 2x2 table
// m = pe[b, pos_offset + l, j] (f32, [r][c] row-major), y[2j + r] = m[r][0] y[2j] + m[r][1]
// y[2j+1] in f32 (multiplied, then added: no fused multiply-add, as ATen), rounded once; with
// neither, copied. D even and at most 256.
struct HeadsShape {
  int64_t batch, seq, heads, dim;
  int64_t src_stride[2];  // of dimensions B, L of the projection (and of its gradient)
  int64_t dst_stride[3];  // of dimensions B, H, L of the output (or of its gradient)
  int64_t pos_offset;     // the stream's first position in pe
  int64_t pe_batch_stride;
};
void HeadsForward(KernelDtype t, const void* src, const void* scale, const float* pe, void* dst,
                  const HeadsShape& shape, float eps, cudaStream_t stream);
// Its backward: dy (through dst_stride) to dsrc (through src_stride, at `dsrc`'s part):
// the rotation's transpose, dy[2j + c] = m[0][c] g[2j] + m[1][c] g[2j+1], rounded to T, then
// RmsNormBackward with the rstd recomputed from x (the forward's src) exactly as the forward
// computed it.
void HeadsBackward(KernelDtype t, const void* dy, const void* src, const void* scale,
                   const float* pe, void* dsrc, const HeadsShape& shape, float eps,
                   cudaStream_t stream);

// The chunked LM head's cross entropy, one row of logits [rows, vocab] (contiguous) per
// block: row_loss[r] = logsumexp(x[r, :]) - x[r, t[r]] in f32 (0 for a target outside
// [0, vocab): -100, the ignored positions). With `grad_in_place`, row r of the logits is
// overwritten with softmax(x[r, :]) - onehot(t[r]) rounded to T (zeros for an ignored row):
// d(sum of row_loss)/d(logits). Two reads and one write of the logits, nothing else.
void CrossEntropyRows(KernelDtype t, void* logits, const int64_t* targets, float* row_loss,
                      int64_t rows, int64_t vocab, bool grad_in_place, cudaStream_t stream);

}  // namespace lorastream::worker::cuda
