#include "worker/flux/flux_calibrate.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/job/job_spec.h"
#include "worker/flux/flux_model.h"
#include "worker/model/quant_expand.h"
#include "worker/model/torch_device.h"
#include "worker/train/calibrate_parts.h"
#include "worker/train/stream_calibrate.h"
#include "worker/train/stream_provider.h"

namespace lorastream::worker::flux {

namespace {

int64_t LoraParams(const FluxConfig& c, const std::vector<std::string>& targets, int64_t rank) {
  int64_t n = 0;
  auto add = [&](const TensorShapes& shapes, int64_t blocks) {
    for (const auto& t : targets)
      for (const auto& [name, shape] : shapes)
        if (name == t + ".weight") n += blocks * rank * (shape[0] + shape[1]);
  };
  add(FluxDoubleBlockShapes(c), c.depth);
  add(FluxSingleBlockShapes(c), c.depth_single);
  return n;
}

}  // namespace

DitMemoryModel FluxJobMemoryModel(const FluxMemoryInputs& in, const FluxJob& job) {
  DitMemoryModel m = FluxMemoryModel(in);
  m.budget_key = FluxKeyName(job, "gpu_memory_budget");
  m.batch_key = FluxKeyName(job, "batch_size");
  return m;
}

FluxMemoryInputs FluxMemoryInputsFor(const FluxBase& base, const FluxJob& job,
                                     const FluxDataset& data, c10::Device device,
                                     c10::ScalarType dtype) {
  FluxMemoryInputs in;
  in.config = base.config();
  in.units = FluxUnits(in.config, base.singles_per_unit());
  const bool compressed = base.engine_manifest().quant().compressed();
  for (const auto& l : base.layouts()) {
    in.unit_bytes.push_back(l.nbytes);
    if (compressed)
      in.expanded_bytes.push_back(static_cast<uint64_t>(ExpandedElements(l)) *
                                  c10::elementSize(dtype));
  }
  for (const auto& [name, t] : base.rest())
    in.rest_bytes += static_cast<uint64_t>(t.numel() * t.element_size());
  in.lora_params =
      LoraParams(in.config, FluxTargets(job.targets, FluxKeyName(job, "targets")), job.rank);
  in.lora_rank = job.rank;
  in.eight_bit_optimizer = job.optimizer == "adamw8bit";
  in.batch = job.batch_size;
  const auto [h, w] = data.largest_latent();
  in.image_tokens = (h / 2) * (w / 2);
  in.text_tokens = data.text_tokens();
  in.compute_bytes = static_cast<int>(c10::elementSize(dtype));
  in.attention_materialized = TORCH_VERSION_MAJOR < 2 || !device.is_cuda();
  in.fused_heads = dit::JointHeadsFused(device, dtype, in.config.head_dim());
  in.group_stacked = dit::StackJobsByDefault(device);
  if (!device.is_cuda()) in.reserve_bytes = 0;  // the slack is the CUDA caching allocator's
  return in;
}

StepCosts MeasureFluxCosts(const FluxBase& base, const FluxJob& job, const FluxMemoryInputs& in,
                           const FluxDataset& data, c10::Device device, c10::ScalarType dtype) {
  const FluxConfig& config = base.config();
  AvoidCudnnAttention(device);
  const bool gpu = device.is_cuda();
  const int64_t b = job.batch_size, lt = data.text_tokens();
  const auto [lh, lw] = data.largest_latent();
  const int64_t n = (lh / 2) * (lw / 2);
  const auto opts = at::TensorOptions(device).dtype(dtype);
  at::Generator gen = at::detail::createCPUGenerator(17);
  auto randn = [&](std::vector<int64_t> shape) {
    return at::empty(shape, at::kFloat).normal_(0, 1, gen).to(opts);
  };
  FluxAdapter adapter(config, FluxTargets(job.targets, FluxKeyName(job, "targets")), job.rank,
                      job.alpha, 1, device, FluxKeyName(job, "rank"));
  FluxCompute c;
  c.config = &config;
  c.vec = randn({b, config.hidden_size});
  c.pe = RopeTable(at::cat({at::zeros({b, lt, 3}, at::TensorOptions(device).dtype(at::kFloat)),
                            ImageIds(b, lh, lw, device)},
                           1),
                   config);
  c.lora_scale = adapter.scale();
  const at::Tensor img = randn({b, n, config.hidden_size}),
                   txt = randn({b, lt, config.hidden_size});

  // One unit of each kind, resident on the device: its forward and its recompute+backward.
  auto measure = [&](size_t u, double* fwd, double* bwd) {
    const FluxUnit& unit = in.units[u];
    const at::Tensor bytes =
        at::from_blob(const_cast<uint8_t*>(base.unit_bytes()[u]),
                      {static_cast<int64_t>(base.layouts()[u].nbytes)}, at::kByte)
            .to(device);
    // A compressed unit computes with its expanded linears (expanding is measured apart).
    const SegmentInfo& layout = base.layouts()[u];
    at::Tensor expanded;
    const NamedTensors w =
        HasCompressedWeights(layout)
            ? ExpandBlock(bytes, layout, dtype, &expanded, BlockNaming::kByName).named
            : BlockWeightsFromBytes(bytes, layout, BlockNaming::kByName).named;
    LoraMap lora;
    std::vector<at::Tensor> params;
    for (const auto& m : adapter.UnitModules(unit)) {
      lora[m] = adapter.modules().at(m);
      params.push_back(lora[m].a);
      params.push_back(lora[m].b);
    }
    const std::vector<at::Tensor> streams = unit.is_double
                                                ? std::vector<at::Tensor>{img, txt}
                                                : std::vector<at::Tensor>{at::cat({txt, img}, 1)};
    const UnitSeconds t = MeasureUnitSeconds(
        [&](const std::vector<at::Tensor>& s) { return UnitForward(unit, s, w, lora, c); }, streams,
        params, gpu);
    *fwd = t.forward;
    *bwd = t.backward;
  };
  double double_fwd = 0, double_bwd = 0, single_fwd = 0, single_bwd = 0;
  int64_t single_count = 0;
  size_t first_single = in.units.size();
  for (size_t u = 0; u < in.units.size(); ++u)
    if (!in.units[u].is_double) {
      first_single = u;
      single_count = in.units[u].count;
      break;
    }
  if (config.depth > 0) measure(0, &double_fwd, &double_bwd);
  if (first_single < in.units.size()) measure(first_single, &single_fwd, &single_bwd);

  StepCosts costs;
  double per_single = single_count > 0 ? single_bwd / static_cast<double>(single_count) : 0;
  if (config.depth > 0) {
    costs.block_forward_seconds = double_fwd;
    costs.block_backward_seconds = double_bwd;
  } else {  // the block figures are a single block's
    costs.block_forward_seconds = single_fwd / static_cast<double>(single_count);
    costs.block_backward_seconds = per_single;
  }
  costs.block_scale = FluxBlockScale(
      in, costs.block_backward_seconds > 0 ? per_single / costs.block_backward_seconds : 1.0);

  // The optimizer's step over the adapter with its clipping: the step's tail.
  costs.tail_seconds = MeasureOptimizerSeconds(adapter.Params(), job.max_grad_norm,
                                               job.optimizer == "adamw8bit", gpu);
  uint64_t largest = 0;
  for (uint64_t bytes : in.unit_bytes) largest = std::max(largest, bytes);
  costs.h2d_bytes_per_second = MeasureH2DBandwidth(largest, device);
  // A compressed store's unit expands on the device at its uses: the first unit measured,
  // the others scaled by their expanded elements (expansion streams its bytes: linear in them).
  double expand_ms = 0;
  if (!in.expanded_bytes.empty()) {
    costs.block_expand_seconds = MeasureBlockExpansion(
        base.unit_bytes()[0], base.layouts()[0], device, dtype, gpu ? 5 : 2, BlockNaming::kByName);
    for (uint64_t e : in.expanded_bytes)
      costs.block_expand_scale.push_back(static_cast<double>(e) / in.expanded_bytes[0]);
    expand_ms = costs.block_expand_seconds * 1e3;
  }
  LS_LOG_INFO(
      "FLUX calibration on {} at {} image + {} text tokens x{}: double unit fwd {:.2f} ms, "
      "recompute+bwd {:.2f} ms; single unit ({} blocks) fwd {:.2f} ms, recompute+bwd {:.2f} ms; "
      "optimizer {:.2f} ms; H2D {:.1f} GB/s; expanding unit 0's compressed linears {:.2f} ms",
      device.str(), n, lt, b, double_fwd * 1e3, double_bwd * 1e3, single_count, single_fwd * 1e3,
      single_bwd * 1e3, costs.tail_seconds * 1e3, costs.h2d_bytes_per_second / 1e9, expand_ms);
  return costs;
}

FluxPlanning PlanFluxJob(const FluxBase& base, const FluxJob& job, const FluxDataset& data,
                         c10::Device device, c10::ScalarType dtype, bool predict,
                         const FluxPlanGroup& group) {
  FluxPlanning p;
  p.budget = JobMemoryBudget(job.gpu_memory_budget, job.budget_auto, device);
  static_cast<DitPlanning&>(p) = PlanDitUnits(
      p.budget, predict,
      p.budget > 0
          ? ResidencyPlan{}
          : base.SwapPlan(job.blocks_to_swap, job.ring_size, FluxKeyName(job, "blocks_to_swap")),
      job.taped_blocks,
      [&] {
        p.inputs = FluxMemoryInputsFor(base, job, data, device, dtype);
        p.inputs.group = group.members;
        return DitPlanInputs{FluxJobMemoryModel(p.inputs, job),
                             FluxDitJob(p.inputs, group.first_name), p.inputs.group};
      },
      [&](int64_t batches) {
        FluxJob all = job;  // stacked: every job's samples as one batch
        all.batch_size *= batches;
        return MeasureFluxCosts(base, all, p.inputs, data, device, dtype);
      },
      [&] { return group.member_costs ? group.member_costs() : std::vector<StepCosts>{}; });
  if (!p.choice.candidates.empty()) LS_LOG_INFO("FLUX plan:\n{}", DescribeFluxPlanning(p));
  return p;
}

std::string DescribeFluxPlanning(const FluxPlanning& p) {
  std::ostringstream s;
  const FluxMemoryInputs& in = p.inputs;
  uint64_t dbl = 0, sgl = 0;
  int n_double = 0, n_single = 0;
  for (size_t u = 0; u < in.units.size(); ++u) {
    if (in.units[u].is_double) {
      dbl = std::max(dbl, in.unit_bytes[u]);
      ++n_double;
    } else {
      sgl = std::max(sgl, in.unit_bytes[u]);
      ++n_single;
    }
  }
  s << "units: " << n_double << " double (" << FormatBytes(dbl) << " each) + " << n_single
    << " single (" << FormatBytes(sgl) << " each); rest " << FormatBytes(in.rest_bytes) << "; "
    << in.image_tokens << " image + " << in.text_tokens << " text tokens x" << in.batch << "\n";
  if (!in.expanded_bytes.empty())
    s << "compressed linears: copied as stored, expanded to " << FormatBytes(in.expanded_bytes[0])
      << " (unit 0) at each use, " << p.costs.block_expand_seconds * 1e3 << " ms\n";
  s << DescribeDitPlanning(FluxMemoryModel(in), FluxDitJob(in), in.group, p.choice, p.costs,
                           p.budget);
  return s.str();
}

int RunFluxPlanCommand(const std::string& job_path, const std::string& device_name) {
  const FluxJob job = LoadFluxJob(job_path);
  at::set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  const c10::Device device = TorchDevice(ParseDevice(device_name));
  const c10::ScalarType dtype = job.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const FluxBase base = FluxBase::ForJob(job, dtype, device);
  const FluxDataset data(job.cache_dir, base.config());
  const FluxPlanning p = PlanFluxJob(base, job, data, device, dtype, /*predict=*/true);
  std::printf("%s", DescribeFluxPlanning(p).c_str());
  return 0;
}

}  // namespace lorastream::worker::flux
