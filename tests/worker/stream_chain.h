// A checkpointed chain of blocks computed through a BlockProvider in exactly the trainer's
// Acquire/Release order (forward 0..L-1 without grad, keeping each block's input; backward
// L-1..0, each block recomputed with grad right before its backward), over every weight of
// BlockWeights, with a LoRA-like trainable pair per block. The streaming engine's tests use it
// to compare streamed and resident runs bit for bit without depending on the trainer.
#pragma once

#include <cstring>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "worker/model/block_provider.h"

namespace lorastream::testing {

struct ChainAdapter {
  std::vector<at::Tensor> a, b;  // [r, hidden], [hidden, r] per block, f32, requires grad
};

// Drawn on the CPU (the same values for every device), then moved to `device`.
inline ChainAdapter MakeChainAdapter(int blocks, int64_t hidden, int64_t rank, uint64_t seed,
                                     c10::Device device = c10::Device(c10::kCPU)) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  ChainAdapter ad;
  for (int i = 0; i < blocks; ++i) {
    at::Tensor a = at::randn({rank, hidden}, gen, at::kFloat) * 0.1;
    at::Tensor b = at::randn({hidden, rank}, gen, at::kFloat) * 0.1;
    ad.a.push_back(a.to(device).requires_grad_(true));
    ad.b.push_back(b.to(device).requires_grad_(true));
  }
  return ad;
}

// One block: x [T, hidden] -> [T, hidden], reading every base weight of the block.
inline at::Tensor ChainBlock(const at::Tensor& x, const worker::BlockWeights& w,
                             const at::Tensor& a, const at::Tensor& b) {
  at::Tensor h = x * w.input_norm;
  at::Tensor q = at::matmul(h, w.q_proj.t());
  at::Tensor k = at::matmul(h, w.k_proj.t());
  at::Tensor v = at::matmul(h, w.v_proj.t());
  at::Tensor attn = at::tanh(q) * at::tanh(at::cat({k, v}, -1).sum(-1, /*keepdim=*/true));
  at::Tensor x1 = x + at::matmul(attn, w.o_proj.t()) + at::matmul(at::matmul(x, a.t()), b.t());
  at::Tensor h2 = x1 * w.post_norm;
  at::Tensor mlp = at::silu(at::matmul(h2, w.gate_proj.t())) * at::matmul(h2, w.up_proj.t());
  return at::tanh(x1 + at::matmul(mlp, w.down_proj.t()) * 0.5);  // bounded over any depth
}

struct ChainResult {
  double loss = 0;
  at::Tensor output;  // the last block's output
  std::vector<at::Tensor> grad_a, grad_b;
};

// `inspect` (optional) runs on every acquired block right before its Release, after the
// block's compute: tests use it to check what the compute read.
// `turnaround` (optional) runs between the forward and the backward, where the trainer
// computes the LM head and the loss.
inline ChainResult RunCheckpointedChain(
    worker::BlockProvider& provider, const ChainAdapter& ad, const at::Tensor& x0,
    const std::function<void(int block, const worker::BlockWeights&)>& inspect = {},
    const std::function<void()>& turnaround = {}) {
  const int n = provider.num_blocks();
  std::vector<at::Tensor> inputs(n);
  at::Tensor x = x0;
  {
    c10::NoGradGuard no_grad;
    for (int i = 0; i < n; ++i) {
      const worker::BlockWeights& w = provider.Acquire(i);
      inputs[i] = x;
      x = ChainBlock(x, w, ad.a[i], ad.b[i]);
      if (inspect) inspect(i, w);
      provider.Release(i);
    }
  }
  if (turnaround) turnaround();
  ChainResult r;
  r.output = x.clone();
  at::Tensor out = x.detach().requires_grad_(true);
  at::Tensor loss = (out * out).mean();
  r.loss = loss.item<double>();
  at::Tensor g = torch::autograd::grad({loss}, {out})[0];
  r.grad_a.resize(n);
  r.grad_b.resize(n);
  for (int i = n - 1; i >= 0; --i) {
    const worker::BlockWeights& w = provider.Acquire(i);
    at::Tensor xi = inputs[i].detach().requires_grad_(true);
    at::Tensor y = ChainBlock(xi, w, ad.a[i], ad.b[i]);
    auto grads = torch::autograd::grad({y}, {xi, ad.a[i], ad.b[i]}, {g});
    if (inspect) inspect(i, w);
    provider.Release(i);
    g = grads[0];
    r.grad_a[i] = grads[1];
    r.grad_b[i] = grads[2];
  }
  return r;
}

// Compared on the host: the tensors may live on the GPU (memcmp on device pointers faults).
inline bool BitEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const at::Tensor ha = a.cpu().contiguous();
  const at::Tensor hb = b.cpu().contiguous();
  return std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

inline bool BitEqual(const ChainResult& a, const ChainResult& b) {
  if (std::memcmp(&a.loss, &b.loss, sizeof a.loss) != 0 || !BitEqual(a.output, b.output)) {
    return false;
  }
  for (size_t i = 0; i < a.grad_a.size(); ++i) {
    if (!BitEqual(a.grad_a[i], b.grad_a[i]) || !BitEqual(a.grad_b[i], b.grad_b[i])) return false;
  }
  return true;
}

}  // namespace lorastream::testing
