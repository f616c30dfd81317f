#include "worker/train/micro_batch_runner.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "common/base/log.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/model/moe_mlp.h"
#include "worker/train/adamw.h"
#include "worker/train/graphed_call.h"
#ifdef LORASTREAM_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lorastream::worker {

bool CudaGraphsEnabled() {
#ifdef LORASTREAM_HAVE_CUDA
  const char* v = std::getenv("LORASTREAM_CUDA_GRAPHS");
  return !(v && std::strcmp(v, "0") == 0);
#else
  return false;
#endif
}

bool CudaGraphsApply(const c10::Device& device, c10::ScalarType dtype, double lora_dropout,
                     const ModelConfig& config) {
  return device.is_cuda() && CudaGraphsEnabled() && lora_dropout == 0 &&
         (!config.is_moe() || GroupedMoeAvailable(config, device, dtype));
}

#ifdef LORASTREAM_HAVE_CUDA

struct MicroBatchRunner::Graph : GraphedCall {
  using GraphedCall::GraphedCall;
};

#else
struct MicroBatchRunner::Graph {};
#endif

MicroBatchRunner::MicroBatchRunner(CausalLm& model, const LoraAdapter& adapter, bool allow_graphs)
    : model_(model),
      adapter_(adapter),
      // What does not change during a job: the device, the dropout, whether anything streams.
      may_graph_(allow_graphs &&
                 CudaGraphsApply(model.device(), model.dtype(), adapter.settings().dropout,
                                 model.config()) &&
                 model.provider().step_is_host_only()) {}

MicroBatchRunner::~MicroBatchRunner() = default;

bool MicroBatchRunner::graphed() const {
#ifdef LORASTREAM_HAVE_CUDA
  return graph_ != nullptr && graph_->captured();
#else
  return false;
#endif
}

uint64_t MicroBatchRunner::captured_peak_bytes() const {
#ifdef LORASTREAM_HAVE_CUDA
  return graph_ != nullptr ? graph_->captured_peak_bytes() : 0;
#else
  return 0;
#endif
}

at::Tensor MicroBatchRunner::Eager(const at::Tensor& embeddings, const at::Tensor& targets,
                                   const at::Tensor& loss_divisor, uint64_t dropout_seed) {
  return model_.TrainMicroBatch(embeddings, targets, adapter_, loss_divisor, dropout_seed).detach();
}

at::Tensor MicroBatchRunner::Run(const at::Tensor& embeddings, const at::Tensor& targets,
                                 const at::Tensor& loss_divisor, uint64_t dropout_seed) {
#ifdef LORASTREAM_HAVE_CUDA
  if (may_graph_) {
    if (graph_ == nullptr) graph_ = std::make_unique<Graph>(DeviceIndexOf(embeddings));
    const std::vector<at::Tensor> inputs{embeddings, targets, loss_divisor};
    if (graph_->Accepts(inputs)) {
      at::Tensor loss = graph_->Run(
          inputs,
          [&](const std::vector<at::Tensor>& in) {
            return std::vector<at::Tensor>{Eager(in[0], in[1], in[2], dropout_seed)};
          },
          [&] { return adapter_.Params(); }, [&] { model_.provider().BeginStep(); },
          [&] {
            return "micro-batch of " + std::to_string(embeddings.size(0) * embeddings.size(1)) +
                   " tokens";
          })[0];
      if (graph_->captured()) ++replays_;  // this call replayed it (the capture too)
      return loss;
    }
  }
#endif
  return Eager(embeddings, targets, loss_divisor, dropout_seed);
}

void MicroBatchRunner::ZeroGrad(AdamW& optimizer) {
  ClearGrads(optimizer, graphed() || grads_in_place_);
}

// The group's graphs: one per composition (the jobs of a micro-batch, in order).
struct GroupMicroBatchRunner::Graphs {
#ifdef LORASTREAM_HAVE_CUDA
  std::map<std::vector<size_t>, std::unique_ptr<GraphedCall>> by_jobs;
#endif
};

GroupMicroBatchRunner::GroupMicroBatchRunner(CausalLm& model)
    : model_(model),
      may_graph_(CudaGraphsApply(model.device(), model.dtype(), 0.0, model.config()) &&
                 model.provider().step_is_host_only()),
      graphs_(std::make_unique<Graphs>()) {}

GroupMicroBatchRunner::~GroupMicroBatchRunner() = default;

void GroupMicroBatchRunner::Forget() { graphs_ = std::make_unique<Graphs>(); }

std::vector<at::Tensor> GroupMicroBatchRunner::Run(const std::vector<GroupMicroBatch>& parts,
                                                   const std::vector<size_t>& jobs, bool* graphed) {
  auto eager = [&](const std::vector<GroupMicroBatch>& ps) {
    std::vector<at::Tensor> losses = model_.TrainGroupMicroBatch(ps);
    for (at::Tensor& l : losses) l = l.detach();
    return losses;
  };
  *graphed = false;
#ifdef LORASTREAM_HAVE_CUDA
  bool eligible = may_graph_;
  for (const GroupMicroBatch& p : parts) eligible = eligible && p.adapter->settings().dropout == 0;
  if (eligible) {
    std::unique_ptr<GraphedCall>& g = graphs_->by_jobs[jobs];
    if (g == nullptr) g = std::make_unique<GraphedCall>(DeviceIndexOf(parts[0].embeddings));
    std::vector<at::Tensor> inputs;
    for (const GroupMicroBatch& p : parts)
      inputs.insert(inputs.end(), {p.embeddings, p.targets, p.loss_divisor});
    if (g->Accepts(inputs)) {
      std::vector<at::Tensor> losses = g->Run(
          inputs,
          [&](const std::vector<at::Tensor>& in) {
            std::vector<GroupMicroBatch> ps = parts;
            for (size_t j = 0; j < ps.size(); ++j) {
              ps[j].embeddings = in[3 * j];
              ps[j].targets = in[3 * j + 1];
              ps[j].loss_divisor = in[3 * j + 2];
            }
            return eager(ps);
          },
          [&] {
            std::vector<at::Tensor> params;
            for (const GroupMicroBatch& p : parts) {
              const std::vector<at::Tensor> ps = p.adapter->Params();
              params.insert(params.end(), ps.begin(), ps.end());
            }
            return params;
          },
          [&] { model_.provider().BeginStep(); },
          [&] {
            int64_t tokens = 0;
            for (const GroupMicroBatch& p : parts)
              tokens += p.embeddings.size(0) * p.embeddings.size(1);
            return "group micro-batch of " + std::to_string(parts.size()) + " jobs, " +
                   std::to_string(tokens) + " tokens";
          });
      *graphed = g->captured();  // this call replayed it (the capture too)
      if (*graphed) ++replays_;
      captured_peak_bytes_ = std::max(captured_peak_bytes_, g->captured_peak_bytes());
      return losses;
    }
  }
#endif
  return eager(parts);
}

}  // namespace lorastream::worker
