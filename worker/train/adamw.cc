#include "worker/train/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include "common/base/error.h"
#include "worker/model/fused_ops.h"

#if LORASTREAM_HAVE_CUDA
#include <c10/cuda/CUDAStream.h>

#include "worker/train/cuda/adamw8bit_kernel.h"
#endif

namespace lorastream::worker {

namespace {

// The parameters' runs: consecutive entries of `idx` whose temporaries (`bytes_of` each) fit
// `scratch` together and each of which `joins(previous, next)` the one before it; one larger
// entry a run of its own.
template <class F, class J>
std::vector<std::pair<size_t, size_t>> Runs(const std::vector<size_t>& idx, uint64_t scratch,
                                            const F& bytes_of, const J& joins) {
  std::vector<std::pair<size_t, size_t>> runs;
  size_t begin = 0;
  while (begin < idx.size()) {
    size_t end = begin;
    uint64_t bytes = 0;
    do {
      bytes += bytes_of(idx[end]);
      ++end;
    } while (end < idx.size() && joins(idx[end - 1], idx[end]) &&
             bytes + bytes_of(idx[end]) <= scratch);
    runs.emplace_back(begin, end);
    begin = end;
  }
  return runs;
}

int64_t Blocks(int64_t n) { return (n + kEightBitBlock - 1) / kEightBitBlock; }

// `x` (f32, [blocks, kEightBitBlock]) over each block's `absmax` ([blocks]) rounded to the
// nearest entry of a dynamic map: the index of the first midpoint (`bounds`, 255 of them) not
// below it. With `keep_sign` (the signed map, whose entry 127 is 0) an index whose entry has
// another sign than x moves one entry towards x's side, as bitsandbytes keeps the first
// moment's sign. Returns uint8 of x's shape.
at::Tensor Quantize(const at::Tensor& x, const at::Tensor& absmax, const at::Tensor& bounds,
                    bool keep_sign) {
  // A block of zeros has absmax 0: divided by the smallest normal float it stays 0.
  const at::Tensor scaled = x / absmax.clamp_min(std::numeric_limits<float>::min()).unsqueeze(1);
  at::Tensor index = at::searchsorted(bounds, scaled, /*out_int32=*/true);
  if (keep_sign) {
    constexpr int kZero = 127;
    index.add_(at::logical_and(x.gt(0), index.lt(kZero)).to(at::kInt));
    index.sub_(at::logical_and(x.lt(0), index.ge(kZero)).to(at::kInt));
  }
  return index.to(at::kByte);
}

// Each block's absolute maximum of `x` ([blocks, kEightBitBlock]) and x rounded under it
// (Quantize), flat: a moment as the state keeps it.
std::pair<at::Tensor, at::Tensor> RoundBlocks(const at::Tensor& x, const at::Tensor& bounds,
                                              bool keep_sign) {
  at::Tensor absmax = x.abs().amax(1);
  at::Tensor q = Quantize(x, absmax, bounds, keep_sign).view(-1);
  return {std::move(q), std::move(absmax)};
}

at::Tensor Dequantize(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code) {
  return code.index_select(0, q.to(at::kInt)).view({-1, kEightBitBlock}).mul_(absmax.unsqueeze(1));
}

// The step's scalars in f32, as bitsandbytes' kOptimizerStatic8bit2StateBlockwise computes
// them: p += step_size * m / (sqrt(v) + eps), then p *= decay.
struct EightBitScalars {
  float step_size, eps, decay;
};
EightBitScalars EightBitStepScalars(const AdamWOptions& o, int64_t step, double lr) {
  const float correction1 = 1.0f - std::pow(static_cast<float>(o.beta1), static_cast<float>(step));
  const float correction2 =
      std::sqrt(1.0f - std::pow(static_cast<float>(o.beta2), static_cast<float>(step)));
  return {-static_cast<float>(lr) * correction2 / correction1,
          correction2 * static_cast<float>(o.eps),
          o.weight_decay > 0 ? 1.0f - static_cast<float>(lr * o.weight_decay) : 1.0f};
}

std::vector<float> MakeDynamicMap(bool is_signed) {
  // create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8): for exponents
  // 10^-6 .. 10^0, the midpoints of an f32 linspace(0.1, 1) of 2^i + 1 (signed) or 2^(i+1) + 1
  // points, each times the power of ten in f32 (a Python float times an f32 tensor), both
  // signs where signed; then 0 and 1, sorted.
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int64_t items = is_signed ? (int64_t{1} << i) + 1 : (int64_t{1} << (i + 1)) + 1;
    const at::Tensor b = at::linspace(0.1, 1.0, items, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor means = (b.slice(0, 0, items - 1) + b.slice(0, 1, items)) / 2.0;
    const auto scale = static_cast<float>(std::pow(10.0, -6 + i));
    for (int64_t k = 0; k < items - 1; ++k) {
      const float m = means[k].item<float>();
      data.push_back(scale * m);
      if (is_signed) data.push_back(-scale * m);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  LS_CHECK(data.size() == 256, "the dynamic map has 256 entries");
  std::sort(data.begin(), data.end());
  return data;
}

}  // namespace

at::Tensor DynamicMap(bool is_signed) {
  // Made once (values, not tensors: nothing of LibTorch to outlive at exit).
  static const std::vector<float> maps[2] = {MakeDynamicMap(false), MakeDynamicMap(true)};
  return at::tensor(maps[is_signed ? 1 : 0]);
}

at::Tensor DequantizeMoment(const at::Tensor& q, const at::Tensor& absmax, bool first) {
  return Dequantize(q, absmax, DynamicMap(first).to(q.device())).view(-1);
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions options)
    : params_(std::move(params)), options_(options) {
  if (options_.scratch_bytes == 0)
    options_.scratch_bytes = OptimizerScratchBytes(options_.eight_bit);
  const size_t count = params_.size();
  q_offset_.assign(count, -1);
  block_offset_.assign(count, -1);
  flat_params_.resize(count);
  int64_t bytes = 0, blocks = 0;
  at::Device device(at::kCPU);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& p = params_[i];
    if (options_.eight_bit && p.numel() >= kEightBitMinElements && p.is_contiguous() &&
        p.scalar_type() == at::kFloat) {
      LS_CHECK(bytes == 0 || p.device() == device, "8-bit moments: parameters on two devices");
      device = p.device();
      q_offset_[i] = bytes;
      block_offset_[i] = blocks;
      bytes += Blocks(p.numel()) * kEightBitBlock;
      blocks += Blocks(p.numel());
      flat_params_[i] = p.detach().view(-1);  // the same memory, outside autograd
    }
  }
  for (int which = 0; which < 2; ++which) {
    absmax_[which].resize(count);
    if (bytes == 0) continue;
    // bitsandbytes' start: every index 0 under an absolute maximum of 0 (moments of 0).
    flat_q_[which] = at::zeros({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    flat_absmax_[which] = at::zeros({blocks}, at::TensorOptions().dtype(at::kFloat).device(device));
    const at::Tensor code = DynamicMap(which == 0);
    code_[which] = code.to(device);
    bounds_[which] = ((code.slice(0, 0, 255) + code.slice(0, 1, 256)) / 2).to(device);
  }
  std::vector<int64_t> first_block, numel, addresses;
  for (size_t i = 0; i < count; ++i) {
    if (q_offset_[i] >= 0) {
      eight_bit_order_.push_back(i);
      first_block.push_back(block_offset_[i]);
      numel.push_back(params_[i].numel());
      addresses.push_back(reinterpret_cast<int64_t>(params_[i].data_ptr()));
    }
  }
  if (bytes > 0 && device.is_cuda()) {
    const auto tensor = [&](const std::vector<int64_t>& v) {
      return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(device);
    };
    kernel_first_block_ = tensor(first_block);
    kernel_numel_ = tensor(numel);
    kernel_params_ = tensor(addresses);
    kernel_addresses_ = addresses;
  }
  for (size_t i = 0; i < count; ++i) {
    if (q_offset_[i] < 0) {
      exp_avg_.push_back(at::zeros_like(params_[i], at::MemoryFormat::Preserve).detach());
      exp_avg_sq_.push_back(at::zeros_like(params_[i], at::MemoryFormat::Preserve).detach());
      continue;
    }
    const int64_t n = Blocks(params_[i].numel());
    exp_avg_.push_back(flat_q_[0].narrow(0, q_offset_[i], n * kEightBitBlock));
    exp_avg_sq_.push_back(flat_q_[1].narrow(0, q_offset_[i], n * kEightBitBlock));
    for (int which = 0; which < 2; ++which)
      absmax_[which][i] = flat_absmax_[which].narrow(0, block_offset_[i], n);
  }
}

at::Tensor AdamW::Moment(size_t i, int which) const {
  const at::Tensor& kept = which == 0 ? exp_avg_[i] : exp_avg_sq_[i];
  if (!absmax_[which][i].defined()) return kept;
  return Dequantize(kept, absmax_[which][i], code_[which])
      .view(-1)
      .narrow(0, 0, params_[i].numel())
      .view(params_[i].sizes());
}

void AdamW::SetMoment(size_t i, int which, const at::Tensor& value) {
  c10::NoGradGuard no_grad;
  at::Tensor& kept = which == 0 ? exp_avg_[i] : exp_avg_sq_[i];
  if (!absmax_[which][i].defined()) {
    kept.copy_(value);
    return;
  }
  const int64_t n = params_[i].numel();
  at::Tensor x = at::zeros({kept.numel()}, kept.options().dtype(at::kFloat));
  x.narrow(0, 0, n).copy_(value.reshape(-1));
  const auto [q, absmax] = RoundBlocks(x.view({-1, kEightBitBlock}), bounds_[which], which == 0);
  absmax_[which][i].copy_(absmax);
  kept.copy_(q);
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
  std::vector<size_t> f32, eight;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    (eight_bit(i) ? eight : f32).push_back(i);
  }
  if (!f32.empty()) StepF32(f32, lr);
  if (!eight.empty() && !StepEightBitKernel(lr)) StepEightBit(eight, lr);
}

bool AdamW::StepEightBitKernel(double lr) {
#if LORASTREAM_HAVE_CUDA
  // LORASTREAM_ADAMW8BIT_KERNEL=0 (or LORASTREAM_FUSED_KERNELS=0): the ATen path, to compare.
  static const bool enabled = [] {
    const char* v = std::getenv("LORASTREAM_ADAMW8BIT_KERNEL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  if (!kernel_params_.defined() || !enabled || !FusedKernelsEnabled()) return false;
  // The gradients' addresses (0: none this step), where every one is a contiguous f32 tensor
  // on the parameters' device.
  std::vector<int64_t> grads;
  grads.reserve(eight_bit_order_.size());
  for (size_t k = 0; k < eight_bit_order_.size(); ++k) {
    const size_t i = eight_bit_order_[k];
    // A parameter moved to other memory since the tables were made: the ATen path.
    if (reinterpret_cast<int64_t>(params_[i].data_ptr()) != kernel_addresses_[k]) return false;
    const at::Tensor& g = params_[i].grad();
    if (!g.defined()) {
      grads.push_back(0);
      continue;
    }
    if (!g.is_contiguous() || g.scalar_type() != at::kFloat || g.device() != params_[i].device())
      return false;
    grads.push_back(reinterpret_cast<int64_t>(g.data_ptr()));
  }
  const at::Tensor table =
      at::tensor(grads, at::TensorOptions().dtype(at::kLong)).to(kernel_params_.device());
  cuda::EightBitStep s;
  s.first_block = kernel_first_block_.data_ptr<int64_t>();
  s.numel = kernel_numel_.data_ptr<int64_t>();
  s.params = reinterpret_cast<float* const*>(kernel_params_.data_ptr<int64_t>());
  s.grads = reinterpret_cast<const float* const*>(table.data_ptr<int64_t>());
  s.count = static_cast<int64_t>(eight_bit_order_.size());
  s.blocks = flat_absmax_[0].numel();
  s.q1 = flat_q_[0].data_ptr<uint8_t>();
  s.q2 = flat_q_[1].data_ptr<uint8_t>();
  s.absmax1 = flat_absmax_[0].data_ptr<float>();
  s.absmax2 = flat_absmax_[1].data_ptr<float>();
  s.code1 = code_[0].data_ptr<float>();
  s.code2 = code_[1].data_ptr<float>();
  s.bounds1 = bounds_[0].data_ptr<float>();
  s.bounds2 = bounds_[1].data_ptr<float>();
  const EightBitScalars k = EightBitStepScalars(options_, step_, lr);
  s.beta1 = static_cast<float>(options_.beta1);
  s.beta2 = static_cast<float>(options_.beta2);
  s.eps = k.eps;
  s.step_size = k.step_size;
  s.decay = k.decay;
  cuda::EightBitAdamWStep(
      s, c10::cuda::getCurrentCUDAStream(kernel_params_.device().index()).stream());
  // The table's memory goes back to the caching allocator on this stream, after the kernel.
  return true;
#else
  (void)lr;
  return false;
#endif
}

void AdamW::StepF32(const std::vector<size_t>& idx, double lr) {
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bias_correction1 = 1 - std::pow(b1, static_cast<double>(step_));
  const double bias_correction2 = 1 - std::pow(b2, static_cast<double>(step_));
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  // torch's multi-tensor ("foreach") AdamW: the same arithmetic per element as the
  // single-tensor path, in a few fused launches instead of ~8 per tensor (a model of 224
  // LoRA tensors would otherwise spend milliseconds per step launching kernels on a GPU),
  // over runs of parameters whose sqrt(v) temporaries fit options_.scratch_bytes.
  const double decay = 1 - lr * options_.weight_decay;
  const auto bytes_of = [&](size_t i) {
    return static_cast<uint64_t>(exp_avg_sq_[i].numel()) * exp_avg_sq_[i].element_size();
  };
  const auto any = [](size_t, size_t) { return true; };
  for (const auto& [begin, end] : Runs(idx, options_.scratch_bytes, bytes_of, any)) {
    std::vector<at::Tensor> p, g, m, v;
    for (size_t k = begin; k < end; ++k) {
      p.push_back(params_[idx[k]]);
      g.push_back(params_[idx[k]].grad());
      m.push_back(exp_avg_[idx[k]]);
      v.push_back(exp_avg_sq_[idx[k]]);
    }
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
  }
}

void AdamW::StepEightBit(const std::vector<size_t>& idx, double lr) {
  const double b1 = options_.beta1, b2 = options_.beta2;
  const EightBitScalars k = EightBitStepScalars(options_, step_, lr);
  // Runs: parameters next to each other in the state's buffers (none skipped between them)
  // whose temporaries fit the scratch; one larger parameter is a run of its own.
  const auto elements_of = [&](size_t i) { return exp_avg_[i].numel(); };
  const auto bytes_of = [&](size_t i) {
    return static_cast<uint64_t>(elements_of(i)) * kEightBitScratchPerElement;
  };
  const auto adjacent = [&](size_t previous, size_t next) {
    return q_offset_[next] == q_offset_[previous] + elements_of(previous);
  };
  for (const auto& [begin, end] : Runs(idx, options_.scratch_bytes, bytes_of, adjacent)) {
    int64_t elements = 0;
    for (size_t r = begin; r < end; ++r) elements += elements_of(idx[r]);
    // The run's gradients gathered flat (each parameter's padded with zeros to whole blocks);
    // its moments and maxima are one range of the state's buffers.
    std::vector<at::Tensor> grads, params;
    std::vector<int64_t> sizes;  // each parameter's elements and its padding, in turn
    for (size_t k = begin; k < end; ++k) {
      const size_t i = idx[k];
      const int64_t n = params_[i].numel(), padded = elements_of(i);
      grads.push_back(params_[i].grad().reshape(-1));
      if (padded > n) grads.push_back(at::zeros({padded - n}, grads.back().options()));
      sizes.push_back(n);
      sizes.push_back(padded - n);
      params.push_back(flat_params_[i]);
    }
    const int64_t first = q_offset_[idx[begin]], blocks = elements / kEightBitBlock;
    at::Tensor q1 = flat_q_[0].narrow(0, first, elements);
    at::Tensor q2 = flat_q_[1].narrow(0, first, elements);
    at::Tensor a1 = flat_absmax_[0].narrow(0, block_offset_[idx[begin]], blocks);
    at::Tensor a2 = flat_absmax_[1].narrow(0, block_offset_[idx[begin]], blocks);
    const at::Tensor g = at::cat(grads).view({-1, kEightBitBlock});
    grads.clear();
    at::Tensor m = Dequantize(q1, a1, code_[0]);
    m.mul_(static_cast<float>(b1)).add_(g, 1.0f - static_cast<float>(b1));
    at::Tensor v = Dequantize(q2, a2, code_[1]);
    v.mul_(static_cast<float>(b2)).addcmul_(g, g, 1.0f - static_cast<float>(b2));
    // p += step_size * m / (sqrt(v) + correction2 * eps), then the decoupled decay.
    at::Tensor update = v.sqrt().add_(k.eps);
    update = at::div(m, update).mul_(k.step_size).view(-1);
    {
      const std::vector<at::Tensor> split = update.split_with_sizes(sizes);
      std::vector<at::Tensor> pieces;
      pieces.reserve(params.size());
      for (size_t k = 0; k < params.size(); ++k) pieces.push_back(split[2 * k]);
      at::_foreach_add_(params, pieces);
    }
    update = at::Tensor();
    if (k.decay != 1.0f) at::_foreach_mul_(params, k.decay);
    const auto [new_q1, new_a1] = RoundBlocks(m, bounds_[0], true);
    const auto [new_q2, new_a2] = RoundBlocks(v, bounds_[1], false);  // v >= 0: |v| is v
    q1.copy_(new_q1);
    q2.copy_(new_q2);
    a1.copy_(new_a1);
    a2.copy_(new_a2);
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
