#include "worker/qwen_image/qwen_image_calibrate.h"

#include <sstream>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/formats/quant_format.h"
#include "worker/qwen_image/qwen_image_model.h"
#include "worker/stream/unit_pack.h"
#include "worker/train/calibrate_parts.h"
#include "worker/train/stream_calibrate.h"
#include "worker/train/stream_provider.h"

namespace lorastream::worker::qwen_image {

QwenImageMemoryInputs QwenImageMemoryInputsFor(const QwenImageConfig& config,
                                               const Manifest& manifest, const JobSpec& spec,
                                               const std::vector<JobSpec>& others,
                                               c10::Device device, c10::ScalarType dtype) {
  QwenImageMemoryInputs in;
  in.config = config;
  const bool compressed = manifest.quant().compressed();  // a store's fp8 or nf4 blocks
  for (const SegmentInfo& block : manifest.blocks) {
    in.block_bytes.push_back(block.nbytes);
    if (compressed)
      in.expanded_bytes.push_back(static_cast<uint64_t>(ExpandedElements(block)) *
                                  c10::elementSize(dtype));
  }
  in.rest_bytes = manifest.rest.nbytes;
  in.job = QwenImageDitJob(spec, config);
  for (const JobSpec& other : others) in.group.push_back(QwenImageDitJob(other, config));
  in.compute_bytes = static_cast<int>(c10::elementSize(dtype));
  in.attention_materialized = TORCH_VERSION_MAJOR < 2 || !device.is_cuda();
  in.fused_heads = dit::JointHeadsFused(device, dtype, in.config.head_dim);
  in.group_stacked = dit::StackJobsByDefault(device);
  if (!device.is_cuda()) in.reserve_bytes = 0;  // the slack is the CUDA caching allocator's
  return in;
}

namespace {

// One job's figures (a group's step adds every job's compute).
StepCosts MeasureJob(const QwenImageConfig& config, const JobSpec& spec, const DitJob& shape,
                     c10::Device device, c10::ScalarType dtype) {
  dit::AvoidCudnnAttention(device);
  const bool gpu = device.is_cuda();
  const auto opts = at::TensorOptions(device).dtype(dtype);
  at::Generator gen = at::detail::createCPUGenerator(17);
  auto randn = [&](const std::vector<int64_t>& shape, double scale) {
    return (at::empty(shape, at::kFloat).normal_(0, 1, gen) * scale).to(opts);
  };
  // Block 0 of the model's shape; its time does not depend on its values.
  NamedTensors w;
  for (const auto& [name, shape] : QwenImageUnitShapes(config, 0)) w[name] = randn(shape, 0.02);
  const QwenImageAdapter adapter(
      config, QwenImageTargets(spec.lora.targets, spec.source + ": key `lora.targets`"),
      spec.lora.rank, spec.lora.alpha, 1, device);
  const LoraMap lora = adapter.UnitLora(0);
  std::vector<at::Tensor> params;
  for (const auto& [name, m] : lora) {
    params.push_back(m.a);
    params.push_back(m.b);
  }
  // A square grid of the job's image tokens (their layout does not change the work).
  int64_t gh = 1;
  while ((gh + 1) * (gh + 1) <= shape.image_tokens) ++gh;
  const int64_t gw = std::max<int64_t>(1, shape.image_tokens / gh);
  const int64_t b = shape.batch, n = gh * gw, lt = std::max<int64_t>(1, shape.text_tokens);
  QwenImageCompute c;
  c.config = &config;
  c.temb = randn({b, config.hidden()}, 1.0);
  c.pe = QwenRopeTable(config, {{gh, gw}}, lt, device);
  c.lora_scale = adapter.scale();
  const std::vector<at::Tensor> streams = {randn({b, n, config.hidden()}, 1.0),
                                           randn({b, lt, config.hidden()}, 1.0)};
  const UnitSeconds t = MeasureUnitSeconds(
      [&](const std::vector<at::Tensor>& s) { return QwenImageBlockForward(0, s, w, lora, c); },
      streams, params, gpu);
  StepCosts costs;
  costs.block_forward_seconds = t.forward;
  costs.block_backward_seconds = t.backward;
  costs.tail_seconds = MeasureOptimizerSeconds(adapter.Params(), spec.optim.grad_clip,
                                               spec.optim.type == "adamw8bit", gpu);
  return costs;
}

}  // namespace

StepCosts MeasureQwenImageCosts(const QwenImageConfig& config, const JobSpec& spec,
                                const QwenImageMemoryInputs& in, c10::Device device,
                                c10::ScalarType dtype) {
  StepCosts costs = MeasureJob(config, spec, in.job, device, dtype);
  costs.h2d_bytes_per_second = MeasureH2DBandwidth(in.block_bytes.front(), device);
  LS_LOG_INFO(
      "Qwen-Image calibration on {} at {} image + {} text tokens x{}: block fwd {:.2f} ms, "
      "recompute+bwd {:.2f} ms; optimizer {:.2f} ms; H2D {:.1f} GB/s",
      device.str(), in.job.image_tokens, in.job.text_tokens, in.job.batch,
      costs.block_forward_seconds * 1e3, costs.block_backward_seconds * 1e3,
      costs.tail_seconds * 1e3, costs.h2d_bytes_per_second / 1e9);
  return costs;
}

QwenImagePlanning PlanQwenImageJob(const QwenImageConfig& config, const Manifest& manifest,
                                   const JobSpec& spec, const std::vector<JobSpec>& others,
                                   c10::Device device, c10::ScalarType dtype, bool predict) {
  QwenImagePlanning p;
  p.budget = JobMemoryBudget(spec.stream, device);
  // The job file's plan (not read within a budget).
  const ResidencyPlan hand =
      p.budget > 0
          ? ResidencyPlan{}
          : UnitSwapPlan(static_cast<int>(manifest.blocks.size()), spec.stream.blocks_to_swap,
                         spec.stream.ring_size, "stream.blocks_to_swap");
  static_cast<DitPlanning&>(p) = PlanDitUnits(
      p.budget, predict, hand, spec.stream.taped_blocks,
      [&] {
        p.inputs = QwenImageMemoryInputsFor(config, manifest, spec, others, device, dtype);
        return DitPlanInputs{QwenImageMemoryModel(p.inputs), p.inputs.job, p.inputs.group};
      },
      [&](int64_t batches) {
        if (batches == 1) return MeasureQwenImageCosts(config, spec, p.inputs, device, dtype);
        DitJob all = p.inputs.job;  // stacked: every job's samples as one batch
        all.batch *= batches;
        return MeasureJob(config, spec, all, device, dtype);
      },
      [&] {
        std::vector<StepCosts> each;
        for (size_t j = 0; j < others.size(); ++j)
          each.push_back(MeasureJob(config, others[j], p.inputs.group[j], device, dtype));
        return each;
      });
  if (!p.choice.candidates.empty())
    LS_LOG_INFO("Qwen-Image plan:\n{}", DescribeQwenImagePlanning(p));
  return p;
}

std::string DescribeQwenImagePlanning(const QwenImagePlanning& p) {
  const QwenImageMemoryInputs& in = p.inputs;
  std::ostringstream s;
  s << "blocks: " << in.block_bytes.size() << " ("
    << FormatBytes(in.block_bytes.empty() ? 0 : in.block_bytes.front()) << " each); rest "
    << FormatBytes(in.rest_bytes) << "; " << in.job.image_tokens << " image + "
    << in.job.text_tokens << " text tokens x" << in.job.batch;
  if (!in.group.empty()) s << "; a group of " << in.group.size() + 1 << " jobs";
  s << "\n"
    << DescribeDitPlanning(QwenImageMemoryModel(in), in.job, in.group, p.choice, p.costs, p.budget);
  return s.str();
}

}  // namespace lorastream::worker::qwen_image
