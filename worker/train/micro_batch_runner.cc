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

c10::DeviceIndex DeviceIndexOf(const at::Tensor& t) {
  return t.device().has_index() ? t.device().index() : c10::cuda::current_device();
}

}  // namespace

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

// A call whose device work is the same every time, run from a CUDA graph: the first call
// eagerly on the capture stream (lazy state: rotary tables, cuBLAS's handles and
// workspaces), the second captured into a private memory pool, later ones replayed after
// their inputs were copied into the graph's. The parameters' gradients exist before the
// capture (zeros), so that the graph accumulates into them.
class GraphedCall {
 public:
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

  explicit GraphedCall(c10::DeviceIndex index) : index_(index), stream_(CaptureStream(index)) {}

  bool failed() const { return failed_; }
  bool captured() const { return graph_ != nullptr; }
  uint64_t captured_peak_bytes() const { return captured_peak_bytes_; }
  // Whether `inputs` can be replayed: the captured shapes (anything before the capture).
  bool Accepts(const std::vector<at::Tensor>& inputs) const {
    if (failed_) return false;
    if (!captured()) return true;
    if (inputs.size() != inputs_.size()) return false;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (!inputs_[i].sizes().equals(inputs[i].sizes())) return false;
    return true;
  }

  // fn(inputs) (outputs of the caller's own: a replay's are copied). On a failed capture
  // nothing ran: `restart` is called and fn runs eagerly, now and from then on. `params`
  // (the parameters fn accumulates gradients into) and `what` (the call's name in the log)
  // are asked for only when capturing.
  std::vector<at::Tensor> Run(const std::vector<at::Tensor>& inputs, const Fn& fn,
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
  if (!graphed() && !grads_in_place_) {
    optimizer.ZeroGrad();
    return;
  }
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : optimizer.params())
    if (p.grad().defined()) grads.push_back(p.grad());
  at::_foreach_zero_(grads);
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
