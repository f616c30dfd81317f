#include "worker/train/graphed_call.h"

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "worker/model/block_provider.h"
#include "worker/train/adamw.h"
#include "worker/train/family.h"
#ifdef LORASTREAM_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace lorastream::worker {

void ClearGrads(AdamW& optimizer, bool in_place) {
  if (!in_place) {
    optimizer.ZeroGrad();
    return;
  }
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : optimizer.params())
    if (p.grad().defined()) grads.push_back(p.grad());
  at::_foreach_zero_(grads);
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

c10::DeviceIndex DeviceIndexOf(const at::Tensor& t) {
  return t.device().has_index() ? t.device().index() : c10::cuda::current_device();
}

GraphedCall::GraphedCall(c10::DeviceIndex index) : index_(index), stream_(CaptureStream(index)) {}

GraphedCall::~GraphedCall() = default;

bool GraphedCall::Accepts(const std::vector<at::Tensor>& inputs) const {
  if (failed_) return false;
  if (!captured()) return true;
  if (inputs.size() != inputs_.size()) return false;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!inputs_[i].sizes().equals(inputs[i].sizes())) return false;
  return true;
}

std::vector<at::Tensor> GraphedCall::Run(const std::vector<at::Tensor>& inputs, const Fn& fn,
                                         const std::function<std::vector<at::Tensor>()>& params,
                                         const std::function<void()>& restart,
                                         const std::function<std::string()>& what) {
  ++calls_;
  if (calls_ == 1) {
    std::vector<at::Tensor> out;
    OnStream(stream_, [&] { out = fn(inputs); });
    return out;
  }
  if (graph_ == nullptr) {
    inputs_.clear();
    for (const at::Tensor& t : inputs) inputs_.push_back(t.clone());
    for (const at::Tensor& p : params()) {
      if (!p.grad().defined()) {
        at::Tensor param = p;  // the adapter's tensor: the gradient lands there
        param.mutable_grad() = at::zeros_like(p);
      }
    }
    // The eager calls' cached memory goes back to the device for the graph's pool to take.
    c10::cuda::CUDACachingAllocator::emptyCache();
    c10::cuda::CUDACachingAllocator::resetPeakStats(index_);
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      OnStream(stream_, [&] {
        graph->capture_begin();
        try {
          outputs_ = fn(inputs_);
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
      LS_LOG_WARN("training: capturing {} as a CUDA graph failed, running eagerly: {}", what(),
                  e.what());
      failed_ = true;
      outputs_.clear();
      inputs_.clear();
      restart();
      return fn(inputs);
    }
    graph_ = std::move(graph);
    captured_peak_bytes_ = static_cast<uint64_t>(
        c10::cuda::CUDACachingAllocator::getDeviceStats(index_).allocated_bytes[0].peak);
    LS_LOG_INFO("training: {} captured as a CUDA graph (peak {:.2f} GiB)", what(),
                static_cast<double>(captured_peak_bytes_) / (1ull << 30));
  } else {
    for (size_t i = 0; i < inputs.size(); ++i) inputs_[i].copy_(inputs[i]);
  }
  graph_->replay();
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : outputs_) out.push_back(t.clone());
  return out;
}

struct GraphedStep::Graph {
  explicit Graph(c10::DeviceIndex index) : call(index) {}
  GraphedCall call;
};

#else

struct GraphedStep::Graph {};

#endif

GraphedStep::GraphedStep(bool may_graph) : may_graph_(may_graph) {}

GraphedStep::~GraphedStep() = default;

void GraphedStep::Forget() {
  graph_.reset();
  given_up_ = false;
  key_.clear();
}

std::vector<at::Tensor> GraphedStep::Run(const std::string& key,
                                         const std::vector<at::Tensor>& inputs, const Fn& fn,
                                         const std::function<std::vector<at::Tensor>()>& params,
                                         const std::function<void()>& restart,
                                         const std::function<std::string()>& what, bool* graphed) {
  *graphed = false;
#ifdef LORASTREAM_HAVE_CUDA
  if (may_graph_ && !given_up_ && !inputs.empty()) {
    if (graph_ == nullptr) {
      graph_ = std::make_unique<Graph>(DeviceIndexOf(inputs[0]));
      key_ = key;
    }
    if (key == key_ && graph_->call.Accepts(inputs)) {
      std::vector<at::Tensor> out = graph_->call.Run(inputs, fn, params, restart, what);
      *graphed = graph_->call.captured();
      if (*graphed)
        captured_peak_bytes_ = std::max(captured_peak_bytes_, graph_->call.captured_peak_bytes());
      return out;
    }
    // Another group, other shapes, or a failed capture: no graph per bucket (each would keep
    // a step's activations); its memory goes back before this step runs.
    LS_LOG_INFO("training: {} runs eagerly from now on (not the captured step's {})", what(),
                graph_->call.failed() ? "capture"
                : key != key_         ? "jobs"
                                      : "shapes");
    graph_.reset();
    given_up_ = true;
    c10::cuda::CUDACachingAllocator::emptyCache();
  }
#else
  (void)key;
  (void)params;
  (void)restart;
  (void)what;
#endif
  return fn(inputs);
}

std::vector<std::vector<at::Tensor>> RunGroupStep(
    GraphedStep& graphs, const std::vector<FamilyJob*>& jobs, const std::string& shape_key,
    const std::vector<at::Tensor>& inputs, const GraphedStep::Fn& fn, BlockProvider& provider,
    const std::string& what, bool* graphed) {
  std::string key;  // the jobs: their adapters and gradients are in a graph
  for (const FamilyJob* job : jobs) key += std::to_string(reinterpret_cast<uintptr_t>(job)) + ";";
  const std::vector<at::Tensor> losses = graphs.Run(
      key + shape_key, inputs, fn,
      [&] {
        std::vector<at::Tensor> params;
        for (const FamilyJob* job : jobs)
          for (const at::Tensor& p : job->Params()) params.push_back(p);
        return params;
      },
      [&] { provider.BeginStep(); },
      [&] { return what + " of " + std::to_string(jobs.size()) + " job(s)"; }, graphed);
  LS_CHECK(losses.size() == jobs.size(), "a group step returns one loss per job");
  std::vector<std::vector<at::Tensor>> out;
  for (const at::Tensor& loss : losses) out.push_back({loss});
  return out;
}

}  // namespace lorastream::worker
