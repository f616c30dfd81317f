#include "worker/train/evaluate.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"

namespace lorastream::worker {

at::Tensor ToDeviceLong(const std::vector<int64_t>& v, int64_t rows, int64_t cols,
                        c10::Device device) {
  return at::from_blob(const_cast<int64_t*>(v.data()), {rows, cols}, at::kLong).to(device).clone();
}

at::Tensor EvalLossSum(CausalLm& model, const LoraAdapter& adapter, const Batch& batch) {
  // Not InferenceMode: the model caches rotary tables, which training must be able to use.
  c10::NoGradGuard no_grad;
  model.provider().BeginStep();
  at::Tensor ids = ToDeviceLong(batch.ids, batch.rows, batch.seq_len, at::kCPU);
  at::Tensor targets = ToDeviceLong(batch.targets, batch.rows, batch.seq_len, model.device());
  // Plain (not checkpointed) blocks: without grad they keep nothing, and the provider sees
  // the forward half of a pass only.
  at::Tensor hidden = model.Hidden(ids, adapter, /*training=*/false, /*checkpointed=*/false,
                                   /*dropout_seed=*/0);
  // The chunked head without grad: forward only, no gradient work, no logits of the whole
  // sequence.
  return model.HeadLossSum(hidden, targets);
}

EvalResult Evaluate(CausalLm& model, const LoraAdapter& adapter, const SequenceSet& set,
                    int64_t rows, int64_t batches) {
  LS_CHECK(rows > 0, "evaluation batch size > 0");
  EvalResult result;
  const int64_t wanted = batches > 0 ? std::min(set.count, batches * rows) : set.count;
  double loss_sum = 0.0;
  for (int64_t first = 0; first < wanted; first += rows) {
    std::vector<int64_t> indices;
    for (int64_t i = first; i < std::min(wanted, first + rows); ++i) indices.push_back(i);
    const Batch batch = MakeBatchOf(set, indices);
    loss_sum += EvalLossSum(model, adapter, batch).item<double>();
    result.tokens += batch.n_targets;
  }
  StepStats discarded;
  model.provider().EndStep(discarded);
  if (result.tokens > 0) result.loss = loss_sum / static_cast<double>(result.tokens);
  return result;
}

}  // namespace lorastream::worker
