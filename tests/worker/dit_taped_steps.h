// What the diffusion families' taped-unit and group tests share (include after torch_catch.h):
// how a model ran, read from the autograd graph behind its output (its checkpointed units, its
// taped ones), a few AdamW steps of a group recorded for a bit-for-bit comparison, and one
// group step's predictions and gradients.
#pragma once

#include <algorithm>
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

// One step of a group: each job's prediction and LoRA gradients (its loss the mean square of
// its prediction against 0.1, as the job alone has it), and whether the model ran the jobs
// stacked.
struct GroupStepResult {
  std::vector<at::Tensor> outputs;
  std::vector<std::vector<at::Tensor>> grads;
  bool stacked = false;
};
template <class Model, class Batch, class Adapter>
GroupStepResult GroupStep(Model& model, const std::vector<Batch>& batches,
                          std::vector<Adapter>& adapters, bool checkpointed) {
  std::vector<const Batch*> bs;
  std::vector<const Adapter*> as;
  for (size_t j = 0; j < batches.size(); ++j) {
    bs.push_back(&batches[j]);
    as.push_back(&adapters[j]);
    for (auto& p : adapters[j].Params())
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
  model.provider().BeginStep();
  const std::vector<at::Tensor> preds = model.ForwardGroup(bs, as, checkpointed);
  GroupStepResult r;
  r.stacked = model.last_forward_stacked();
  at::Tensor loss;
  for (size_t j = 0; j < preds.size(); ++j) {
    const at::Tensor l = (preds[j] - 0.1).pow(2).mean();
    loss = loss.defined() ? loss + l : l;
  }
  loss.backward();
  StepStats stats;
  model.provider().EndStep(stats);
  for (size_t j = 0; j < preds.size(); ++j) {
    r.outputs.push_back(preds[j].detach());
    r.grads.emplace_back();
    for (auto& p : adapters[j].Params())
      r.grads.back().push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  }
  return r;
}

// The worst max|got - want| / max|want| over the tensors.
inline double WorstRelErr(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, (got[i] - want[i]).abs().max().item<double>() /
                                std::max(want[i].abs().max().item<double>(), 1e-30));
  return worst;
}

// A stacked group of `batches` with `adapters` (`group(batches, adapters, checkpointed, swap)`
// runs one GroupStep of a model that stacks) against each job alone (`alone(batch, adapter,
// checkpointed)`): stacked, each job's prediction and gradients within 1e-5 of its own,
// checkpointed and under plain autograd; every one of `units` units streamed through one slot,
// the resident stacked group's bits.
template <class Batch, class Adapter, class GroupFn, class AloneFn>
void CheckStackedLikeAlone(const GroupFn& group, const AloneFn& alone,
                           const std::vector<Batch>& batches, std::vector<Adapter>& adapters,
                           int units) {
  for (bool checkpointed : {true, false}) {
    INFO((checkpointed ? "checkpointed" : "plain autograd"));
    const GroupStepResult got = group(batches, adapters, checkpointed, 0);
    REQUIRE(got.stacked);
    for (size_t j = 0; j < batches.size(); ++j) {
      INFO("job " << j);
      const GroupStepResult want = alone(batches[j], adapters[j], checkpointed);
      CHECK_FALSE(want.stacked);
      CHECK(WorstRelErr({got.outputs[j]}, want.outputs) < 1e-5);
      CHECK(WorstRelErr(got.grads[j], want.grads[0]) < 1e-5);
    }
  }
  const GroupStepResult resident = group(batches, adapters, true, 0);
  const GroupStepResult streamed = group(batches, adapters, true, units);
  REQUIRE(streamed.stacked);
  CHECK(AllEqual(streamed.outputs, resident.outputs));
  for (size_t j = 0; j < batches.size(); ++j) CHECK(AllEqual(streamed.grads[j], resident.grads[j]));
}

// A group that does not stack (`got`) against each job alone: the same bits.
template <class Batch, class Adapter, class AloneFn>
void CheckUnstackedLikeAlone(const GroupStepResult& got, const AloneFn& alone,
                             const std::vector<Batch>& batches,
                             const std::vector<Adapter>& adapters) {
  CHECK_FALSE(got.stacked);
  for (size_t j = 0; j < batches.size(); ++j) {
    const GroupStepResult want = alone(batches[j], adapters[j], true);
    CHECK(at::equal(got.outputs[j], want.outputs[0]));
    CHECK(AllEqual(got.grads[j], want.grads[0]));
  }
}

}  // namespace lorastream::testing
