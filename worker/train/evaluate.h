// Evaluation: the loss of the adapter on a fixed set of sequences, through the same model and
// block provider as training (resident or streamed), with autograd off: no graph is built and
// no activation is kept, so an evaluation needs less memory than a training step.
#pragma once

#include <cstdint>
#include <limits>

#include <ATen/core/Tensor.h>

#include "common/formats/data.h"
#include "worker/model/model.h"

namespace lorastream::worker {

struct EvalResult {
  double loss = std::numeric_limits<double>::quiet_NaN();  // token-weighted mean
  int64_t tokens = 0;                                      // target tokens evaluated
};

// A [rows, cols] int64 tensor on `device` holding `v` (token ids or shifted targets).
at::Tensor ToDeviceLong(const std::vector<int64_t>& v, int64_t rows, int64_t cols,
                        c10::Device device);

// The summed cross-entropy of one batch (an f32 scalar on the model's device), computed in a
// forward-only pass under c10::NoGradGuard (the chunked head: no gradient work, never the
// whole sequence's logits): the result has no grad_fn. The provider is told a
// new step begins first (the streaming engine restarts its pass plan for a forward-only pass).
at::Tensor EvalLossSum(CausalLm& model, const LoraAdapter& adapter, const Batch& batch);

// The mean loss over every target token of the first `batches` batches of `rows` sequences of
// `set`, taken in order (0 = the whole set; the last batch may be short), so that every
// evaluation of a job sees the same tokens. The provider's streaming counters of these passes
// are consumed here (they do not count toward the next training step).
EvalResult Evaluate(CausalLm& model, const LoraAdapter& adapter, const SequenceSet& set,
                    int64_t rows, int64_t batches);

}  // namespace lorastream::worker
