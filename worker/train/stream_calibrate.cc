#include "worker/train/stream_calibrate.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/job/job_spec.h"
#include "common/job/step_stats.h"
#include "worker/model/base_weights.h"
#include "worker/model/block.h"
#include "worker/model/lm_head.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/model/quant_expand.h"
#include "worker/stream/host_bytes.h"
#include "worker/train/adamw.h"
#include "worker/train/calibrate_parts.h"
#include "worker/train/micro_batch_runner.h"
#ifdef LORASTREAM_HAVE_CUDA
#include "worker/stream/cuda/cuda_bandwidth.h"
#endif

namespace lorastream::worker {

namespace {

using Clock = std::chrono::steady_clock;

// Waits for the device's work on `t` (a scalar read syncs the current stream) and returns
// the seconds since `start`.
double SecondsAfter(const at::Tensor& t, Clock::time_point start) {
  (void)t.sum().item<double>();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Warm-ups before a measurement: the allocator, the kernels' first launches, caches, and on a
// GPU its clocks, which rise under sustained load (on an H200 at 512 tokens the first training
// steps took 50 and 40 ms, the steady ones 31 ms): `run` (one run that waits for the device)
// is repeated at least `runs` times and, on CUDA, until `cuda_seconds` have passed.
constexpr double kCudaWarmupSeconds = 0.3;      // before a block or the head alone
constexpr double kCudaStepWarmupSeconds = 1.0;  // before whole steps
constexpr double kCudaMeasureSeconds = 0.5;

template <class Run>
void WarmUp(const c10::Device& device, int runs, double cuda_seconds, Run run) {
  const auto start = Clock::now();
  for (int i = 0;; ++i) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (i >= runs && (!device.is_cuda() || elapsed >= cuda_seconds)) return;
    run();
  }
}

// Median-free mean over `reps` runs after the warm-up.
template <class Fn>
double TimeIt(const c10::Device& device, int reps, Fn fn) {
  WarmUp(device, 1, kCudaWarmupSeconds, [&] { SecondsAfter(fn(), Clock::now()); });
  const auto start = Clock::now();
  at::Tensor last;
  for (int i = 0; i < reps; ++i) last = fn();
  return SecondsAfter(last, start) / reps;
}

BlockWeights BlockOnDevice(const BlockWeights& w, const c10::Device& device,
                           c10::ScalarType dtype) {
  BlockWeights out = w;
  out.ForEachSlot([&](at::Tensor& t) {
    if (t.defined()) t = t.to(device, dtype).contiguous();
  });
  return out;
}

// Whether a job's steps that stream nothing run as CUDA graphs (MicroBatchRunner's rule):
// then the calibration measures them so too.
bool CalibratesGraphs(const JobSpec& spec, const ModelConfig& config, const c10::Device& device,
                      c10::ScalarType dtype) {
  return CudaGraphsApply(device, dtype, spec.lora.dropout, config);
}

}  // namespace

double MeasureH2DBandwidth(uint64_t block_bytes, const c10::Device& device) {
  // Page-aligned, as the engine's sources are; filled so that every page is touched.
  HostBytes src = HostBytes::Allocate(block_bytes, "calibration");
  std::memset(src.data(), 1, block_bytes);
#ifdef LORASTREAM_HAVE_CUDA
  if (device.is_cuda()) {
    return MeasurePinnedH2DBandwidth({{src.data(), block_bytes}},
                                     device.has_index() ? device.index() : 0, 5) *
           1e9;
  }
#endif
  // The CPU backend's copy is a memcpy into a slot.
  std::vector<uint8_t> dst(block_bytes);
  std::memcpy(dst.data(), src.data(), block_bytes);
  const auto start = Clock::now();
  const int reps = 5;
  for (int i = 0; i < reps; ++i) std::memcpy(dst.data(), src.data(), block_bytes);
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  return s > 0 ? reps * static_cast<double>(block_bytes) / s : 0.0;
}

std::string CalibrationKey(const JobSpec& spec, const BaseWeights& base, const c10::Device& device,
                           c10::ScalarType dtype) {
  const ModelConfig& c = base.config();
  std::string targets;
  for (const std::string& t : spec.lora.targets) targets += t.substr(0, 1);
  const int64_t tokens = spec.train.batch_size * spec.data.seq_len;
  // The LM head's rows per chunk: its time depends on them (and on the fused cross entropy,
  // which sets them; LORASTREAM_FUSED_KERNELS=0 turns it off).
  const int64_t chunk_rows = DefaultHeadChunkRows(c, tokens, device.is_cuda(), dtype);
  return base.name_or_path() + "-" + c.model_type + "-L" + std::to_string(c.num_hidden_layers) +
         "-H" + std::to_string(c.hidden_size) + "-I" + std::to_string(c.intermediate_size) + "-V" +
         std::to_string(c.vocab_size) + "-" + device.str() + "-" + c10::toString(dtype) + "-r" +
         std::to_string(spec.lora.rank) + "-" + targets + "-T" + std::to_string(tokens) + "-C" +
         std::to_string(chunk_rows) +
         // From whole steps, each ending in its one wait, after warm-ups that raise the
         // clocks, and the optimizer's tail measured alone (older entries: a block alone, or
         // steps that waited twice, measured cold, or a tail only from the steps'
         // difference); with the steps that stream nothing measured as CUDA graphs where
         // they run so.
         "-steps3" + (CalibratesGraphs(spec, c, device, dtype) ? "-graphs" : "") +
         // 8-bit moments change the optimizer's tail.
         (spec.optim.type == "adamw8bit" ? "-adamw8bit" : "") +
         // A compressed store expands its blocks at their uses.
         (base.manifest() != nullptr && base.manifest()->quant().compressed()
              ? std::string("-") + QuantMethodName(base.manifest()->quant().method)
              : std::string());
}

namespace {

// One block's device weights served as each of `count` blocks: a model of the job's
// block shape, for timing whole training steps.
class RepeatedBlockProvider : public BlockProvider {
 public:
  RepeatedBlockProvider(const BlockWeights& w, int count) : w_(w), count_(count) {}
  int num_blocks() const override { return count_; }
  void BeginStep() override {}
  const BlockWeights& Acquire(int) override { return w_; }
  void Release(int) override {}
  void EndStep(StepStats&) override {}
  bool step_is_host_only() const override { return true; }

 private:
  const BlockWeights& w_;
  int count_;
};

// What a model of repeated blocks of the job's shape needs, on the device.
struct RepeatedModelParts {
  const ModelConfig* config;
  const LoraSettings* settings;
  const BlockWeights* block;
  RestWeights rest;  // the embedding table in host RAM, as training keeps it
  HeadProvider* head;
  at::Tensor ids, targets;
  c10::Device device;
  c10::ScalarType dtype;
};

// The median time of a training step of a model of `blocks` copies of block 0, run as the
// trainer runs one (worker/train/trainer.cc): the checkpointed blocks, the chunked head and loss,
// the backward, gradient clipping and AdamW, the next step's embeddings gathered on the host,
// then the one read of the loss and the norm. What the isolated timings miss (launches, autograd,
// allocations, the host gather, the waits) is in it.
double RepeatedModelStepSeconds(const RepeatedModelParts& p, int blocks, int reps,
                                bool allow_graphs) {
  ModelConfig config = *p.config;
  config.num_hidden_layers = blocks;
  const LoraAdapter adapter = LoraAdapter::Init(config, *p.settings, 0, p.device);
  RepeatedBlockProvider provider(*p.block, blocks);
  CausalLm model(config, p.rest, &provider, p.device, p.dtype, p.head);
  const std::vector<at::Tensor> params = adapter.Params();
  AdamW optimizer(params, AdamWOptions{});
  MicroBatchRunner runner(model, adapter, allow_graphs);
  const at::Tensor divisor = model.LossDivisor(p.targets.numel());
  at::Tensor embeddings = model.Embed(p.ids);
  auto step = [&] {
    const auto start = Clock::now();
    provider.BeginStep();
    const at::Tensor loss = runner.Run(embeddings, p.targets, divisor, 0);
    const at::Tensor norm = ClipGradNormAsync(params, 1.0);
    optimizer.Step(1e-9);
    runner.ZeroGrad(optimizer);
    embeddings = model.Embed(p.ids);  // the next step's, before the step's one wait
    (void)at::stack({loss.detach().to(at::kFloat), norm}).sum().item<double>();
    StepStats stats;
    provider.EndStep(stats);
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  WarmUp(p.device, 2, kCudaStepWarmupSeconds, step);
  // The median of `reps` steps at least and, on CUDA, of kCudaMeasureSeconds of them: a short
  // step is bound by the host's launches, and a few of them vary by a third on a busy host.
  std::vector<double> seconds;
  double total = 0;
  while (static_cast<int>(seconds.size()) < reps ||
         (p.device.is_cuda() && total < kCudaMeasureSeconds)) {
    seconds.push_back(step());
    total += seconds.back();
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

}  // namespace

StepCosts MeasureStepCosts(const JobSpec& spec, const BaseWeights& base, const c10::Device& device,
                           c10::ScalarType dtype) {
  const ModelConfig& config = base.config();
  const int64_t rows = spec.train.batch_size, seq = spec.data.seq_len;
  const int reps = 3;
  const auto start = Clock::now();
  const LoraSettings settings = LoraSettingsFromSpec(spec.lora);
  const LoraAdapter adapter = LoraAdapter::Init(config, settings, spec.train.seed, device);
  const BlockWeights w = BlockOnDevice(base.block(0), device, dtype);
  const RotaryTables rope = BuildRotary(config, seq, device, dtype);
  BlockCompute c;
  c.config = &config;
  c.rope = &rope;
  c.lora_scale = settings.Scale();
  c.dropout = settings.dropout;
  c.training = true;
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  const at::Tensor x = at::randn({rows, seq, config.hidden_size}, opts) * 0.1;

  // The block as training runs it (worker/model/block.h), alone: the checkpointed forward, then
  // the recompute onto a tape and the hand-written backward. These give the split between a
  // block's forward and its backward; the whole steps below give their sum.
  StepCosts costs;
  const LoraBlockCast lora = CastLoraBlock(adapter.block(0), dtype);
  const double forward_alone =
      TimeIt(device, reps, [&] { return BlockForwardTaped(x, w, lora, c, /*tape=*/nullptr); });
  const at::Tensor dy = at::ones_like(x);
  const double backward_alone = TimeIt(device, reps, [&] {
    BlockTape tape;
    LoraBlockGrads grads;
    BlockForwardTaped(x, w, lora, c, &tape);
    return BlockBackward(tape, w, lora, c, dy, /*need_dx=*/true, grads);
  });

  // The chunked LM head and loss as training runs it, forward and backward, from the last
  // hidden state (a streamed head's copy is the cost model's, from the bandwidth).
  const at::Tensor norm = base.rest().norm.to(device, dtype);
  // A compressed head as training runs it: expanded per slice at each use.
  const std::unique_ptr<HeadProvider> head = MakeResidentHead(base.rest(), device, dtype);
  const at::Tensor targets = at::randint(config.vocab_size, {rows, seq},
                                         at::TensorOptions().device(device).dtype(at::kLong));
  const int64_t chunk_rows = DefaultHeadChunkRows(config, rows * seq, device.is_cuda(), dtype);
  costs.head_seconds = TimeIt(device, reps, [&] {
    at::Tensor h = x.detach().requires_grad_(true);
    at::Tensor loss = ChunkedHeadLossSum(h, targets, norm, config.rms_norm_eps, *head, chunk_rows);
    loss.backward();
    return h.grad();
  });

  // Whole training steps of two models of this block repeated, as deep as the job's model
  // and half as deep (its weights on the device once): their difference is what one more
  // block costs in a step, the rest of the shorter step (less its blocks and the head) is the
  // step's tail. At full depth the resident step is measured as it runs (at short lengths it
  // is bound by issuing kernels, and a short model issues them faster per block).
  const int deep = std::max(2, static_cast<int>(config.num_hidden_layers));
  const int half = deep / 2;
  RepeatedModelParts parts{&config,      &settings, &w,     RestWeights{}, head.get(),
                           at::Tensor(), targets,   device, dtype};
  parts.rest.embed_tokens = base.rest().embed_tokens;
  parts.rest.packed_embed = base.rest().packed_embed;
  parts.rest.norm = norm;
  parts.ids = at::randint(config.vocab_size, {rows, seq}, at::TensorOptions().dtype(at::kLong));
  const double long_step = RepeatedModelStepSeconds(parts, deep, reps, /*allow_graphs=*/false);
  const double short_step = RepeatedModelStepSeconds(parts, half, reps, /*allow_graphs=*/false);
  // The tail alone: clipping and AdamW over every tensor of the job's adapter. It runs after
  // the last block, where no block's compute hides copies; with many small tensors (a
  // mixture of experts' LoRA: one A and one B per expert and projection) the steps'
  // difference can put it in the blocks' share.
  const double optimizer_alone = MeasureOptimizerSeconds(
      adapter.Params(), spec.optim.grad_clip, spec.optim.type == "adamw8bit", device.is_cuda());
  const double split = forward_alone + backward_alone;
  SplitMeasuredSteps(long_step, deep, short_step, half, split > 0 ? forward_alone / split : 0.0,
                     &costs, optimizer_alone);
  // A plan that streams nothing trains from a CUDA graph (worker/train/micro_batch_runner.h): its
  // full-depth step measured so, against the eager one.
  double graphed_step = 0;
  if (CalibratesGraphs(spec, config, device, dtype)) {
    graphed_step = RepeatedModelStepSeconds(parts, deep, reps, /*allow_graphs=*/true);
    if (long_step > 0) costs.graph_factor = graphed_step / long_step;
  }

  uint64_t block_bytes = 0;
  BlockWeights sized = w;
  sized.ForEachSlot([&](at::Tensor& t) {
    if (t.defined()) block_bytes += t.nbytes();
  });
  costs.h2d_bytes_per_second = MeasureH2DBandwidth(block_bytes, device);
  // A compressed store's block is copied compressed and expanded on the device at its uses.
  const Manifest* stored = base.manifest();
  if (stored != nullptr && stored->quant().compressed())
    costs.block_expand_seconds =
        MeasureBlockExpansion(base.block_bytes()[0], stored->blocks[0], device, dtype);
  LS_LOG_INFO(
      "stream: calibrated on {} at {} tokens in {:.2f} s: {} (a block alone: forward "
      "{:.2f} ms, recompute+backward {:.2f} ms; steps of {} and {} blocks: {:.2f} and "
      "{:.2f} ms; as a CUDA graph {:.2f} ms; clipping and the optimizer alone {:.2f} ms)",
      device.str(), rows * seq, std::chrono::duration<double>(Clock::now() - start).count(),
      costs.Describe(), forward_alone * 1e3, backward_alone * 1e3, half, deep, short_step * 1e3,
      long_step * 1e3, graphed_step * 1e3, optimizer_alone * 1e3);
  return costs;
}

StepCosts CalibratedStepCosts(const JobSpec& spec, const BaseWeights& base,
                              const c10::Device& device, c10::ScalarType dtype) {
  const std::string key = CalibrationKey(spec, base, device, dtype);
  StepCosts costs;
  if (LoadStepCosts(key, &costs)) {
    LS_LOG_INFO("stream: calibration from {}: {}", CalibrationCachePath(key), costs.Describe());
    return costs;
  }
  costs = MeasureStepCosts(spec, base, device, dtype);
  SaveStepCosts(key, costs);
  return costs;
}

}  // namespace lorastream::worker
