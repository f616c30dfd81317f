// Calls replayed from CUDA graphs (at::cuda::CUDAGraph). GraphedCall: one call whose device
// work is the same at every call (the LLM micro-batch runners, worker/train/micro_batch_runner.h,
// keep them). GraphedStep: a family's whole group step (forward and backward of every job),
// graphed while the group, its shapes and what its host decides stay the same (the diffusion
// families: FLUX.1's, worker/flux; Qwen-Image's steps run eagerly).
//
// A graph is captured at the second call (the first runs eagerly on the capture stream: lazy
// state, cuBLAS's handles and workspaces), into a private memory pool, and replayed from then
// on after the inputs were copied into the graph's own. Graphed and eager calls run the same
// kernels in the same order: the same values. The parameters' gradients exist before the
// capture (zeros) and the graph accumulates into them, so that a graphed caller clears
// gradients in place (ClearGrads) instead of setting them to none.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#ifdef LORASTREAM_HAVE_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lorastream::worker {

class AdamW;

// The optimizer's gradients cleared: zeroed in place when a graph may write them (in_place),
// else set to none (torch's default: the next backward writes fresh ones).
void ClearGrads(AdamW& optimizer, bool in_place);

#ifdef LORASTREAM_HAVE_CUDA

c10::DeviceIndex DeviceIndexOf(const at::Tensor& t);

class GraphedCall {
 public:
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

  explicit GraphedCall(c10::DeviceIndex index);
  ~GraphedCall();

  bool failed() const { return failed_; }
  bool captured() const { return graph_ != nullptr; }
  uint64_t captured_peak_bytes() const { return captured_peak_bytes_; }
  // Whether `inputs` can be replayed: the captured shapes (anything before the capture).
  bool Accepts(const std::vector<at::Tensor>& inputs) const;

  // fn(inputs) (outputs of the caller's own: a replay's are copied). On a failed capture
  // nothing ran: `restart` is called and fn runs eagerly, now and from then on. `params`
  // (the parameters fn accumulates gradients into) and `what` (the call's name in the log)
  // are asked for only when capturing.
  std::vector<at::Tensor> Run(const std::vector<at::Tensor>& inputs, const Fn& fn,
                              const std::function<std::vector<at::Tensor>()>& params,
                              const std::function<void()>& restart,
                              const std::function<std::string()>& what);

 private:
  c10::DeviceIndex index_;
  c10::cuda::CUDAStream stream_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;  // set once captured
  std::vector<at::Tensor> inputs_;              // copied in before each replay
  std::vector<at::Tensor> outputs_;
  int64_t calls_ = 0;
  bool failed_ = false;  // a capture failed: eager from then on
  uint64_t captured_peak_bytes_ = 0;
};

#endif

// A group step replayed from one CUDA graph. Graphed when may_graph (a CUDA device,
// CudaGraphsEnabled(), every unit resident: the engine's copies and waits are per step) and
// while every call has the captured call's key and input shapes. The key names what the
// step's device work depends on besides its inputs' shapes: the jobs (their adapters are in
// the graph) and what the host computes from sizes (grids, which optional inputs exist). At
// the first call with another key or other shapes the graph is dropped (its memory freed)
// and the steps run eagerly until Forget(): one graph at most, never one per bucket. Any
// other call is eager; on the CPU every call is.
class GraphedStep {
 public:
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

  explicit GraphedStep(bool may_graph);
  ~GraphedStep();

  // fn(inputs), replayed from the graph when it applies (*graphed: this call replayed it,
  // the capture too), else eagerly. params, restart and what as GraphedCall::Run's.
  std::vector<at::Tensor> Run(const std::string& key, const std::vector<at::Tensor>& inputs,
                              const Fn& fn, const std::function<std::vector<at::Tensor>()>& params,
                              const std::function<void()>& restart,
                              const std::function<std::string()>& what, bool* graphed);
  // The group changed (a job joined or leaves): the graph dropped, graphs allowed again.
  void Forget();
  // Whether steps may be graphed: their gradients are then cleared in place.
  bool may_graph() const { return may_graph_; }
  // What the captured step allocated at most (a replay allocates nothing); 0 before.
  uint64_t captured_peak_bytes() const { return captured_peak_bytes_; }

 private:
  struct Graph;
  bool may_graph_;
  bool given_up_ = false;  // a call with another key or shapes: eager until Forget
  std::string key_;
  std::unique_ptr<Graph> graph_;
  uint64_t captured_peak_bytes_ = 0;
};

class BlockProvider;
class FamilyJob;

// A family's group step (FamilyGroup::RunStep) through `graphs`: fn(inputs) runs every job's
// forward and backward and returns one loss per job, in the jobs' order; `shape_key` names
// what the host decides from sizes beyond the inputs' shapes (the jobs themselves are in the
// key). The provider's step restarts if a capture fails. Returns per job its loss; *graphed:
// whether the step replayed a graph.
std::vector<std::vector<at::Tensor>> RunGroupStep(
    GraphedStep& graphs, const std::vector<FamilyJob*>& jobs, const std::string& shape_key,
    const std::vector<at::Tensor>& inputs, const GraphedStep::Fn& fn, BlockProvider& provider,
    const std::string& what, bool* graphed);

}  // namespace lorastream::worker
