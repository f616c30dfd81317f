// One training step's loss and gradients through a tiny model's LM head, by the full-logits
// path or the chunked one (tests/worker/lm_head_test.cc and tests/gpu/lm_head_cuda_test.cc).
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "common/formats/data.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"

namespace lorastream::testing {

struct HeadRun {
  at::Tensor loss, hidden_grad;   // on the CPU
  std::vector<at::Tensor> grads;  // every LoRA tensor's, on the CPU
};

// Rank 4 on every projection with non-zero B (the same values on every call), so that every
// gradient path carries signal.
inline worker::LoraAdapter RandomLora(const ModelConfig& config, c10::Device device) {
  worker::LoraSettings s;
  s.rank = 4;
  s.alpha = 8;
  s.targets.fill(true);
  worker::LoraAdapter adapter = worker::LoraAdapter::Init(config, s, 11, device);
  c10::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (auto& p : adapter.Params())
    p.copy_(at::empty(p.sizes(), at::kFloat).uniform_(-0.1, 0.1, gen));
  return adapter;
}

// The shifted targets of `ids` with every third position ignored (and the last, as a shift
// leaves it).
inline at::Tensor ShiftedTargets(const at::Tensor& ids) {
  at::Tensor t = at::cat(
      {ids.narrow(1, 1, ids.size(1) - 1), at::full({ids.size(0), 1}, kIgnoreIndex, at::kLong)}, 1);
  t.view({-1}).index_put_({at::arange(0, t.numel(), 3)}, kIgnoreIndex);
  return t;
}

// One step through checkpointed blocks; the loss is divided by 7 before the backward, so that
// a gradient other than 1 reaches the head's backward. chunk_rows 0: the full-logits path.
inline HeadRun RunHead(worker::CausalLm& model, const at::Tensor& ids, int64_t chunk_rows) {
  worker::LoraAdapter adapter = RandomLora(model.config(), model.device());
  model.provider().BeginStep();
  at::Tensor hidden = model.Hidden(ids, adapter, true, /*checkpointed=*/true, 99);
  hidden.retain_grad();
  const at::Tensor targets = ShiftedTargets(ids.cpu());
  at::Tensor loss;
  if (chunk_rows == 0) {
    loss = worker::CausalLm::LossSum(model.Logits(hidden), targets.to(model.device()));
  } else {
    model.set_head_chunk_rows(chunk_rows);
    loss = model.HeadLossSum(hidden, targets);
  }
  (loss / 7.0).backward();
  HeadRun r;
  r.loss = loss.detach().cpu();
  r.hidden_grad = hidden.grad().cpu();
  for (auto& p : adapter.Params()) r.grads.push_back(p.grad().cpu());
  return r;
}

// The largest difference against the largest value of `want` (f32 rounding: a few 1e-6).
inline double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

}  // namespace lorastream::testing
