// Runs a training micro-batch (CausalLm::TrainMicroBatch, or a job group's
// CausalLm::TrainGroupMicroBatch), on CUDA from a CUDA graph when it can. At short lengths a step
// is bound by the host: it issues about 2,000 LibTorch calls (an H200 at 512 tokens ran the
// 16-block step in 27-44 ms, twice its arithmetic), and a graph replays them in one launch.
//
// A micro-batch is graphed when its device work is the same at every call:
//   - a CUDA device, and LORASTREAM_CUDA_GRAPHS is not "0" in the environment (A/B runs);
//   - nothing streams (BlockProvider::step_is_host_only): the engine's copies, events and
//     waits are per step and stay eager;
//   - no LoRA dropout: its masks are seeded from the host at every micro-batch;
//   - the same shapes as the captured call (a batch of another shape runs eagerly).
// The first call runs eagerly on the capture stream (lazy state: the rotary tables, cuBLAS's
// handles and workspaces); the second is captured, on that stream, into a private memory pool
// and replayed; later calls copy their inputs into the graph's and replay it. Graphed and
// eager micro-batches compute the same kernels in the same order: the same values (the GPU
// test checks a graphed training run against an eager one).
//
// Gradients: the graph writes into the adapter's .grad tensors as they were when it was
// captured (accumulating, as autograd does into an existing gradient), so ZeroGrad zeroes
// them in place once a graph exists; setting them to none would cut them off from it.
// The peak device memory of a replay is not seen by the allocator's counters (a replay
// allocates nothing): captured_peak_bytes() is what the captured call allocated at most.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "common/formats/model_config.h"

namespace lorastream::worker {

class AdamW;
class CausalLm;
class LoraAdapter;
struct GroupMicroBatch;

// Whether CUDA graphs may be used: a CUDA build, LORASTREAM_CUDA_GRAPHS not "0".
bool CudaGraphsEnabled();
// Whether a micro-batch of `config` on `device` in `dtype` with LoRA dropout `lora_dropout`
// may be graphed when nothing streams: CUDA, CudaGraphsEnabled(), no dropout, and for a
// mixture of experts the grouped expert GEMMs (GroupedMoeAvailable: the per-expert ones read
// the routing to the host, which a capture cannot do); the calibration asks the same.
bool CudaGraphsApply(const c10::Device& device, c10::ScalarType dtype, double lora_dropout,
                     const ModelConfig& config);

class MicroBatchRunner {
 public:
  // `model` and `adapter` outlive the runner; allow_graphs false: every micro-batch eagerly
  // (the calibration's eager steps).
  MicroBatchRunner(CausalLm& model, const LoraAdapter& adapter, bool allow_graphs);
  ~MicroBatchRunner();
  MicroBatchRunner(const MicroBatchRunner&) = delete;
  MicroBatchRunner& operator=(const MicroBatchRunner&) = delete;

  // CausalLm::TrainMicroBatch's loss, a device scalar of the caller's own (a replay's output
  // is copied: the next replay overwrites the graph's).
  at::Tensor Run(const at::Tensor& embeddings, const at::Tensor& targets,
                 const at::Tensor& loss_divisor, uint64_t dropout_seed);
  // The optimizer's gradients cleared for the next step: set to none while no graph exists
  // (the capture gives every parameter a gradient first), else zeroed in place.
  void ZeroGrad(AdamW& optimizer);
  // From now on ZeroGrad zeroes in place: a group's graph accumulates into these gradients.
  void KeepGradsInPlace() { grads_in_place_ = true; }

  bool graphed() const;                         // a graph was captured and is replayed
  int64_t replays() const { return replays_; }  // micro-batches run from the graph
  uint64_t captured_peak_bytes() const;

 private:
  struct Graph;  // CUDA only (worker/train/micro_batch_runner.cc)
  at::Tensor Eager(const at::Tensor& embeddings, const at::Tensor& targets,
                   const at::Tensor& loss_divisor, uint64_t dropout_seed);

  CausalLm& model_;
  const LoraAdapter& adapter_;
  bool may_graph_;  // allowed, CudaGraphsApply and nothing streams: fixed for the runner's life
  bool grads_in_place_ = false;
  int64_t replays_ = 0;
  std::unique_ptr<Graph> graph_;
};

// A job group's micro-batches (CausalLm::TrainGroupMicroBatch) under the same rules: graphed
// when the device is CUDA, nothing streams and no job of the micro-batch has LoRA dropout;
// one graph per composition (which jobs, in order: `jobs` names them), replayed while their
// shapes stay those captured. The jobs' adapters must keep their gradients in place while a
// graph of theirs exists (MicroBatchRunner::KeepGradsInPlace). Forget() drops every graph
// (a job joined or left: its adapter may be gone).
class GroupMicroBatchRunner {
 public:
  explicit GroupMicroBatchRunner(CausalLm& model);
  ~GroupMicroBatchRunner();
  GroupMicroBatchRunner(const GroupMicroBatchRunner&) = delete;
  GroupMicroBatchRunner& operator=(const GroupMicroBatchRunner&) = delete;

  // Each job's divided loss (device scalars of the caller's own); *graphed: whether it ran
  // from (or was captured into) a graph.
  std::vector<at::Tensor> Run(const std::vector<GroupMicroBatch>& parts,
                              const std::vector<size_t>& jobs, bool* graphed);
  void Forget();
  int64_t replays() const { return replays_; }
  uint64_t captured_peak_bytes() const { return captured_peak_bytes_; }

 private:
  struct Graphs;
  CausalLm& model_;
  bool may_graph_;
  int64_t replays_ = 0;
  uint64_t captured_peak_bytes_ = 0;
  std::unique_ptr<Graphs> graphs_;
};

}  // namespace lorastream::worker
