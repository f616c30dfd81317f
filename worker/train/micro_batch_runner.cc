#include "worker/train/micro_batch_runner.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>

#include <ATen/ATen.h>

#include "common/log.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/train/adamw.h"
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

bool CudaGraphsApply(const c10::Device& device, double lora_dropout) {
  return device.is_cuda() && CudaGraphsEnabled() && lora_dropout == 0;
}

#ifdef LORASTREAM_HAVE_CUDA

namespace {

// One capture stream per device for the process. cuBLAS keeps a workspace per handle and
// stream for the process's life (LibTorch's cache): a stream of the pool's round robin per
// runner would add one (32 MiB per thread that runs GEMMs) for every job a worker trains.
c10::cuda::CUDAStream CaptureStream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(index);
  if (it == streams.end())
    it =
        streams.emplace(index, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)).first;
  return it->second;
}

}  // namespace

// The capture stream, the graph and the tensors it reads and writes.
struct MicroBatchRunner::Graph {
  explicit Graph(c10::DeviceIndex index) : stream(CaptureStream(index)) {}
  c10::cuda::CUDAStream stream;
  std::unique_ptr<at::cuda::CUDAGraph> graph;  // set once captured
  at::Tensor embeddings, targets, divisor;     // the inputs, copied in before each replay
  at::Tensor loss;                             // the output
  bool failed = false;                         // a capture failed: eager from then on
};

namespace {

// fn() on `side` after the work enqueued so far on the current stream; the current stream
// then waits for it. (Tensors made there and used later are used after that wait; the
// caching allocator reuses their memory only for work on `side`.)
template <class Fn>
void OnStream(const c10::cuda::CUDAStream& side, Fn fn) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(side.device_index());
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    fn();
  }
  at::cuda::CUDAEvent done;
  done.record(side);
  done.block(current);
}

}  // namespace

#else
struct MicroBatchRunner::Graph {};
#endif

MicroBatchRunner::MicroBatchRunner(CausalLm& model, const LoraAdapter& adapter, bool allow_graphs)
    : model_(model),
      adapter_(adapter),
      // What does not change during a job: the device, the dropout, whether anything streams.
      may_graph_(allow_graphs && CudaGraphsApply(model.device(), adapter.settings().dropout) &&
                 model.provider().step_is_host_only()) {}

MicroBatchRunner::~MicroBatchRunner() = default;

bool MicroBatchRunner::graphed() const {
#ifdef LORASTREAM_HAVE_CUDA
  return graph_ != nullptr && graph_->graph != nullptr;
#else
  return false;
#endif
}

bool MicroBatchRunner::Eligible(const at::Tensor& embeddings, const at::Tensor& targets) const {
  if (!may_graph_) return false;
#ifdef LORASTREAM_HAVE_CUDA
  if (graph_ != nullptr && graph_->failed) return false;
  return !graphed() || (graph_->embeddings.sizes().equals(embeddings.sizes()) &&
                        graph_->targets.sizes().equals(targets.sizes()));
#else
  (void)embeddings;
  (void)targets;
  return false;
#endif
}

at::Tensor MicroBatchRunner::Eager(const at::Tensor& embeddings, const at::Tensor& targets,
                                   const at::Tensor& loss_divisor, uint64_t dropout_seed) {
  return model_.TrainMicroBatch(embeddings, targets, adapter_, loss_divisor, dropout_seed).detach();
}

at::Tensor MicroBatchRunner::Run(const at::Tensor& embeddings, const at::Tensor& targets,
                                 const at::Tensor& loss_divisor, uint64_t dropout_seed) {
  if (!Eligible(embeddings, targets)) return Eager(embeddings, targets, loss_divisor, dropout_seed);
#ifdef LORASTREAM_HAVE_CUDA
  const c10::DeviceIndex index =
      embeddings.device().has_index() ? embeddings.device().index() : c10::cuda::current_device();
  if (graph_ == nullptr) graph_ = std::make_unique<Graph>(index);
  Graph& g = *graph_;
  ++calls_;
  if (calls_ == 1) {
    // The warm-up, on the capture stream: lazy state is made outside the capture.
    at::Tensor loss;
    OnStream(g.stream, [&] { loss = Eager(embeddings, targets, loss_divisor, dropout_seed); });
    return loss;
  }
  if (g.graph == nullptr) {
    // The graph reads its inputs from tensors of its own and accumulates into gradients that
    // exist when it is captured.
    g.embeddings = embeddings.clone();
    g.targets = targets.clone();
    g.divisor = loss_divisor.clone();
    for (const at::Tensor& p : adapter_.Params()) {
      if (!p.grad().defined()) {
        at::Tensor param = p;  // Params() holds the adapter's tensors: the gradient lands there
        param.mutable_grad() = at::zeros_like(p);
      }
    }
    // The eager calls' cached memory goes back to the device for the graph's pool to take.
    c10::cuda::CUDACachingAllocator::emptyCache();
    c10::cuda::CUDACachingAllocator::resetPeakStats(index);
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      OnStream(g.stream, [&] {
        graph->capture_begin();
        try {
          g.loss = Eager(g.embeddings, g.targets, g.divisor, dropout_seed);
        } catch (...) {
          try {
            graph->capture_end();  // ends the stream's capture; its graph is invalid
          } catch (const std::exception&) {
          }
          throw;
        }
        graph->capture_end();
      });
    } catch (const std::exception& e) {
      // Nothing ran during the capture: the micro-batch runs eagerly, and so does every later
      // one. The provider starts the step's order afresh.
      LS_LOG_WARN("training: capturing the micro-batch as a CUDA graph failed, running eagerly: {}",
                  e.what());
      g.failed = true;
      g.loss = at::Tensor();
      model_.provider().BeginStep();
      return Eager(embeddings, targets, loss_divisor, dropout_seed);
    }
    g.graph = std::move(graph);
    captured_peak_bytes_ = static_cast<uint64_t>(
        c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].peak);
    LS_LOG_INFO("training: micro-batch of {} tokens captured as a CUDA graph (peak {:.2f} GiB)",
                embeddings.size(0) * embeddings.size(1),
                static_cast<double>(captured_peak_bytes_) / (1ull << 30));
  } else {
    g.embeddings.copy_(embeddings);
    g.targets.copy_(targets);
    g.divisor.copy_(loss_divisor);
  }
  g.graph->replay();
  ++replays_;
  return g.loss.clone();
#else
  return Eager(embeddings, targets, loss_divisor, dropout_seed);
#endif
}

void MicroBatchRunner::ZeroGrad(AdamW& optimizer) {
  if (!graphed()) {
    optimizer.ZeroGrad();
    return;
  }
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : optimizer.params())
    if (p.grad().defined()) grads.push_back(p.grad());
  at::_foreach_zero_(grads);
}

}  // namespace lorastream::worker
