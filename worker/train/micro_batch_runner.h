// Runs a training micro-batch (CausalLm::TrainMicroBatch), on CUDA from a CUDA graph when it
// can. At short lengths a step is bound by the host: it issues about 2,000 LibTorch calls
// (an H200 at 512 tokens ran the 16-block step in 27-44 ms, twice its arithmetic), and a graph
// replays them in one launch.
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

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace lorastream::worker {

class AdamW;
class CausalLm;
class LoraAdapter;

// Whether CUDA graphs may be used: a CUDA build, LORASTREAM_CUDA_GRAPHS not "0".
bool CudaGraphsEnabled();
// Whether a micro-batch on `device` with LoRA dropout `lora_dropout` may be graphed when
// nothing streams: CUDA, CudaGraphsEnabled(), no dropout (the calibration asks the same).
bool CudaGraphsApply(const c10::Device& device, double lora_dropout);

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

  bool graphed() const;                         // a graph was captured and is replayed
  int64_t replays() const { return replays_; }  // micro-batches run from the graph
  uint64_t captured_peak_bytes() const { return captured_peak_bytes_; }

 private:
  struct Graph;  // CUDA only (worker/train/micro_batch_runner.cc)
  bool Eligible(const at::Tensor& embeddings, const at::Tensor& targets) const;
  at::Tensor Eager(const at::Tensor& embeddings, const at::Tensor& targets,
                   const at::Tensor& loss_divisor, uint64_t dropout_seed);

  CausalLm& model_;
  const LoraAdapter& adapter_;
  bool may_graph_;     // allowed, CudaGraphsApply and nothing streams: fixed for the runner's life
  int64_t calls_ = 0;  // eligible calls so far
  int64_t replays_ = 0;
  uint64_t captured_peak_bytes_ = 0;
  std::unique_ptr<Graph> graph_;
};

}  // namespace lorastream::worker
