// What the diffusion families' taped-unit tests share (include after torch_catch.h): how a
// model ran, read from the autograd graph behind its output (its checkpointed units, its
// taped ones), and a few AdamW steps of a group recorded for a bit-for-bit comparison.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include "common/job/step_stats.h"
#include "worker/model/block_provider.h"
#include "worker/stream/stream_engine_options.h"
#include "worker/stream/stream_plan.h"
#include "worker/train/adamw.h"

namespace lorastream::testing {

// How many nodes of the graph behind `out` have a name containing `name_part`.
inline int CountGraphNodes(const at::Tensor& out, const std::string& name_part) {
  std::vector<torch::autograd::Node*> todo;
  std::set<torch::autograd::Node*> seen;
  if (const auto& fn = out.grad_fn()) todo.push_back(fn.get());
  int count = 0;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    if (n->name().find(name_part) != std::string::npos) ++count;
    for (const auto& e : n->next_edges())
      if (e.function) todo.push_back(e.function.get());
  }
  return count;
}

// `out` came from `units` units of which `taped` ran taped (plain autograd behind one
// TapedUnitUse node each) and the others checkpointed.
inline void CheckTapedGraph(const at::Tensor& out, int units, int taped) {
  CHECK(CountGraphNodes(out, "CheckpointedUnit") == units - taped);
  CHECK(CountGraphNodes(out, "TapedUnitUse") == taped);
}

// `swap` of `units` units streamed through one slot (their copies poisoned when released), the
// last `taped` resident ones taped.
inline worker::ResidencyPlan TapedPlan(int units, int swap, int taped) {
  worker::ResidencyPlan plan = worker::PlanFromSwapCount(units, swap, 1);
  plan.tape_resident_only = true;
  plan.taped_blocks = taped;
  return plan;
}
inline worker::StreamEngineOptions TapedEngineOptions(const worker::ResidencyPlan& plan) {
  worker::StreamEngineOptions o;
  o.log_plan = false;
  o.debug_poison = plan.num_streamed() > 0;
  return o;
}

// A group of the first `jobs` batches with their adapters, as ForwardGroup takes them, and
// every adapter's parameters in that order.
template <class Batch, class Adapter>
struct GroupJobs {
  GroupJobs(int jobs, const Batch* batches, const std::vector<Adapter>& adapters) {
    for (int j = 0; j < jobs; ++j) {
      this->batches.push_back(&batches[j]);
      this->adapters.push_back(&adapters[j]);
      for (const auto& p : adapters[j].Params()) params.push_back(p);
    }
  }
  std::vector<const Batch*> batches;
  std::vector<const Adapter*> adapters;
  std::vector<at::Tensor> params;
};

struct TrainedSteps {
  std::vector<at::Tensor> losses, grads, params;  // every step's, then the last params
};

// `steps` AdamW steps (lr 1e-2) of `params`: each step between BeginStep and EndStep of
// `provider`, one backward over the sum of the losses `forward` returns (one per job).
inline TrainedSteps TrainSteps(worker::BlockProvider& provider,
                               const std::vector<at::Tensor>& params, int steps,
                               const std::function<std::vector<at::Tensor>()>& forward) {
  worker::AdamW optimizer(params, worker::AdamWOptions{});
  TrainedSteps r;
  for (int step = 0; step < steps; ++step) {
    provider.BeginStep();
    at::Tensor total;
    for (const at::Tensor& loss : forward()) {
      r.losses.push_back(loss.detach().clone());
      total = total.defined() ? total + loss : loss;
    }
    total.backward();
    StepStats stats;
    provider.EndStep(stats);
    for (const auto& p : params)
      r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
    optimizer.Step(1e-2);
    optimizer.ZeroGrad();
  }
  for (const auto& p : params) r.params.push_back(p.detach().clone());
  return r;
}

// Equal bit for bit, tensor by tensor.
inline bool AllEqual(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!at::equal(a[i], b[i])) return false;
  return true;
}

inline void CheckSameSteps(const TrainedSteps& got, const TrainedSteps& want) {
  CHECK(AllEqual(got.losses, want.losses));
  CHECK(AllEqual(got.grads, want.grads));
  CHECK(AllEqual(got.params, want.params));
}

}  // namespace lorastream::testing
