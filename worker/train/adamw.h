// AdamW on the fp32 LoRA master weights, the exact arithmetic of torch.optim.AdamW
// (single-tensor path): decoupled weight decay, lerp for the first moment, bias corrections
// applied to the step size and to sqrt(v). Plus the learning-rate schedules and the global
// gradient-norm clipping of transformers / torch.nn.utils.
//
// With 8-bit moments (AdamWOptions::eight_bit, a job's `[optim] type = "adamw8bit"`) it is
// bitsandbytes' blockwise AdamW8bit. Each moment of a parameter of at least
// kEightBitMinElements elements is one byte per element: an index into a 256-entry dynamic
// map (bitsandbytes' create_dynamic_map, signed for the first moment, unsigned for the
// second), scaled by the absolute maximum of its block of kEightBitBlock elements (one f32
// per block, blocks counted from each parameter's first element). The parameters' moments
// lie one after another in one buffer, so a step gathers only the gradients. A step dequantises a
// run of parameters' moments, updates them in f32 with the gradient, updates the parameters from
// those f32 moments as bitsandbytes' kernel does (p += -lr sqrt(1 - b2^t) / (1 - b1^t) x
// m / (sqrt(v) + sqrt(1 - b2^t) eps), then p *= 1 - lr weight_decay), takes each block's new
// absolute maximum and rounds the moments back to the nearest entry, the first moment
// keeping its sign. Smaller parameters (and any not contiguous f32) keep f32 moments and
// torch's arithmetic, as bitsandbytes' min_8bit_size keeps them. State: 2 + 8/256 bytes per element
// instead of 8.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "worker/stream/stream_budget.h"

namespace lorastream::worker {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // The most bytes of the update's temporaries at once: the parameters are updated in runs
  // whose temporaries (f32 moments: sqrt(v), one f32 per element; 8-bit moments:
  // kEightBitScratchPerElement per element) hold at most this many bytes (one parameter
  // larger than that is a run of its own), so a large adapter (a mixture of experts':
  // hundreds of millions of parameters) needs no second copy of its size at the optimizer
  // step. The arithmetic per element is the same whatever the runs. The memory estimate
  // counts it (worker/stream/stream_budget.h). 0: the default for the moments' kind
  // (OptimizerScratchBytes).
  uint64_t scratch_bytes = 0;
  bool eight_bit = false;  // 8-bit moments (above)
};

class AdamW {
 public:
  AdamW(std::vector<at::Tensor> params, AdamWOptions options);
  // One update with each parameter's .grad() at learning rate `lr` (parameters without a
  // gradient are skipped, as torch does).
  void Step(double lr);
  void ZeroGrad();

  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }
  // Each parameter's moments as kept: f32 of the parameter's shape, or (8-bit) a flat uint8
  // of its elements rounded up to whole blocks, with exp_avg_absmax()/exp_avg_sq_absmax() (f32,
  // one per block; undefined for a parameter with f32 moments).
  std::vector<at::Tensor>& exp_avg() { return exp_avg_; }
  std::vector<at::Tensor>& exp_avg_sq() { return exp_avg_sq_; }
  std::vector<at::Tensor>& exp_avg_absmax() { return absmax_[0]; }
  std::vector<at::Tensor>& exp_avg_sq_absmax() { return absmax_[1]; }
  bool eight_bit(size_t i) const { return absmax_[0][i].defined(); }
  // Parameter i's first (which = 0) or second moment in f32, of the parameter's shape,
  // dequantised where it is kept in 8 bits; and set from such a tensor (quantised where it
  // is kept so): how a checkpoint written with the other kind of moments resumes.
  at::Tensor Moment(size_t i, int which) const;
  void SetMoment(size_t i, int which, const at::Tensor& value);
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  void StepF32(const std::vector<size_t>& idx, double lr);
  void StepEightBit(const std::vector<size_t>& idx, double lr);
  // On CUDA: the whole 8-bit step as one kernel (worker/train/cuda/adamw8bit_kernel.h);
  // false where it does not apply (the ATen path then runs).
  bool StepEightBitKernel(double lr);

  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_;
  std::vector<at::Tensor> absmax_[2];
  // 8-bit moments: every such parameter's bytes and block maxima, one after another in the
  // parameters' order, in one buffer each (exp_avg_ and the others view them), so that a run
  // of parameters reads and writes its state as one range; each such parameter's first byte
  // and first block there, and its elements viewed flat.
  at::Tensor flat_q_[2], flat_absmax_[2];
  std::vector<int64_t> q_offset_, block_offset_;
  std::vector<at::Tensor> flat_params_;
  // The kernel's tables on the device, in the state's order: each 8-bit parameter's first
  // block, elements and address (int64), and which parameter that is.
  at::Tensor kernel_first_block_, kernel_numel_, kernel_params_;
  std::vector<size_t> eight_bit_order_;
  std::vector<int64_t> kernel_addresses_;  // the parameters' addresses the table holds
  at::Tensor code_[2], bounds_[2];  // the dynamic maps and the midpoints between their entries
  AdamWOptions options_;
  int64_t step_ = 0;
};

// An 8-bit moment's bytes (flat, whole blocks) with its block maxima, in f32 (flat): the
// signed map for the first moment (`first`), the unsigned one for the second.
at::Tensor DequantizeMoment(const at::Tensor& q, const at::Tensor& absmax, bool first);

// bitsandbytes' create_dynamic_map(signed) (max_exponent_bits 7, total_bits 8): 256 sorted
// f32 values in [-1, 1] (signed) or [0, 1], holding 0 and 1.
at::Tensor DynamicMap(bool is_signed);

// The learning-rate multiplier of transformers' get_{constant,linear,cosine}_schedule_with_warmup
// at scheduler step `step` (0 for the first optimizer step).
double ScheduleFactor(const std::string& schedule, int64_t step, int64_t warmup_steps,
                      int64_t total_steps);

// torch.nn.utils.clip_grad_norm_: returns the global 2-norm before clipping, an f32 scalar on
// the gradients' device; when max_norm > 0 multiplies every gradient by
// min(1, max_norm / (norm + 1e-6)), that factor staying on the device as torch 2 keeps it. Nothing
// waits for the device: the step reads the norm with its loss, once (worker/train/trainer.cc).
// Undefined when no parameter has a gradient.
at::Tensor ClipGradNormAsync(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace lorastream::worker
