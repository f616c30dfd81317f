#include "worker/serve/plan_command.h"

#include <cstdio>

#include <ATen/Context.h>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/formats/quant_format.h"
#include "common/job/job_spec.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/torch_device.h"
#include "worker/stream/stream_cost.h"
#include "worker/stream/stream_engine.h"
#include "worker/train/group_trainer.h"
#include "worker/train/stream_calibrate.h"
#include "worker/train/stream_provider.h"

namespace lorastream::worker {

namespace {

// The plans of `specs` as one group (the first job's plan and calibration); one spec: one job.
int PrintPlans(const std::vector<JobSpec>& specs, const PlanCommandOptions& options) {
  const JobSpec& spec = specs.front();
  const Device typed_device = ParseDevice(options.device);
  const c10::Device device = TorchDevice(typed_device);
  if (device.is_cuda() && !at::hasCUDA())
    throw Error(ErrorCode::kUnsupported,
                "--device " + options.device + ": this build or machine has no CUDA");
  const BaseWeights base = BaseWeights::ForJob(spec);
  for (const JobSpec& s : specs) {
    RequireValidJobSpec(s, &base.config());  // train.dtype among the rest
    const std::string refusal = GroupRefusal(spec, s, options.device);
    if (!refusal.empty()) throw Error(ErrorCode::kRefused, refusal);
  }
  const DType compute = ComputeDType(spec.train.dtype, typed_device);
  const std::string dtype_name = ShortDTypeName(compute);
  const c10::ScalarType dtype = ScalarTypeOf(compute, "the compute dtype");

  const Manifest layout = ComputeLayout(base, dtype);
  MemoryModelInputs inputs = JobMemoryInputs(spec, layout, device, dtype);
  AddGroupJobs({specs.begin() + 1, specs.end()}, &inputs);
  if (specs.size() > 1) {
    std::printf("group of %zu jobs, planned from job %s's [stream]:\n", specs.size(),
                spec.name.c_str());
    for (const JobSpec& s : specs)
      std::printf("  job %s: %lld tokens per micro-batch x %lld, rank %lld on %zu targets\n",
                  s.name.c_str(), static_cast<long long>(s.train.batch_size * s.data.seq_len),
                  static_cast<long long>(s.train.grad_accum), static_cast<long long>(s.lora.rank),
                  s.lora.targets.size());
  }
  uint64_t budget = JobMemoryBudget(spec.stream, device);
  if (budget > 0 && specs.size() > 1) RefuseGroupBeyondBudget(inputs, budget, spec.name);
  StepCosts costs;
  if (options.recalibrate) {
    costs = MeasureStepCosts(spec, base, device, dtype);
    SaveStepCosts(CalibrationKey(spec, base, device, dtype), costs);
  } else {
    costs = CalibratedStepCosts(spec, base, device, dtype);
  }
  // A group's compute: every job's, measured at its own shape.
  costs = JobGroupCosts(costs, {specs.begin() + 1, specs.end()}, base, device, dtype);
  std::string budget_from = spec.stream.budget_auto
                                ? "stream.gpu_memory_budget = \"auto\" (" +
                                      std::to_string(static_cast<int>(kAutoBudgetFraction * 100)) +
                                      "% of the memory free on " + device.str() + ")"
                                : "stream.gpu_memory_budget";
  if (budget == 0) {
    const ResidencyPlan own = PlanResidency(spec.stream.blocks_to_swap, 0, spec.stream.ring_size,
                                            inputs, spec.stream.forward_slots,
                                            spec.stream.backward_slots, spec.stream.taped_blocks);
    budget = EstimateMemory(inputs, own).total();
    budget_from = "the estimated peak of the job's own plan (" + own.Describe() + ")";
  }
  const PlanChoice choice = ChoosePlan(inputs, costs, budget);
  const int layers = base.config().num_hidden_layers;
  // A compressed store's blocks: the bytes copied, their format and what they expand to.
  const std::string compressed =
      layout.quant().compressed()
          ? " " + DescribeQuant(layout.quant()) + ", expanding to " +
                FormatBytes(inputs.expanded_bytes.empty() ? 0 : inputs.expanded_bytes[0])
          : "";
  // The LM head's bytes on the device and, compressed, its format and slices.
  const TensorSlice* head = layout.head();
  const std::string head_format = head != nullptr && head->quant.compressed()
                                      ? std::string(" ") + QuantMethodName(head->quant.method) +
                                            ", expanded in slices of " +
                                            std::to_string(inputs.head_slice_rows) + " rows"
                                      : "";
  std::printf(
      "job %s: %s, %d blocks of %s%s, LM head %s%s, %lld tokens per micro-batch, device %s, "
      "%s\n",
      spec.name.c_str(), base.config().model_type.c_str(), layers,
      FormatBytes(inputs.block_bytes.empty() ? 0 : inputs.block_bytes[0]).c_str(),
      compressed.c_str(), FormatBytes(inputs.head_bytes).c_str(), head_format.c_str(),
      static_cast<long long>(inputs.tokens), device.str().c_str(), dtype_name.c_str());
  if (specs.size() > 1)
    std::printf("(the group: every job's measured compute, the copies once; its memory)\n");
  std::printf("measured: %s; resident step predicted %.1f ms\n", costs.Describe().c_str(),
              costs.ResidentStepSeconds(layers) * 1e3);
  std::printf("budget from %s\n%s", budget_from.c_str(), DescribeChoice(choice, budget).c_str());
  std::printf(
      "legend: one row per plan the cost model weighed; * marks the one chosen (the fastest "
      "whose peak fits).\n"
      "  swap N ring R: N blocks streamed from the store through R device slots (swap 0: all "
      "resident);\n"
      "  fwd/head/bwd: slots held in the forward, across the LM head and in the backward; taped "
      "T: the last T blocks\n"
      "  keep their activations (no recompute); head streamed: the LM head is copied too. "
      "resident = blocks kept on\n"
      "  the device, copied GB = bytes copied per step, stall ms = compute waiting on copies, "
      "peak GiB = estimated\n"
      "  device memory. Rows that differ only in slots or taped blocks are variants of one "
      "residency.\n");
  return 0;
}

}  // namespace

int RunPlanCommand(const std::string& job_path, const PlanCommandOptions& options) {
  return RunPlanCommand(std::vector<std::string>{job_path}, options);
}

int RunPlanCommand(const std::vector<std::string>& job_paths, const PlanCommandOptions& options) {
  std::vector<JobSpec> specs;
  for (const std::string& path : job_paths) {
    specs.push_back(LoadJobSpec(path));
    ApplyInitFrom(specs.back().lora);  // lora.init_from: the adapter's rank and targets
  }
  if (specs.empty()) throw Error(ErrorCode::kInvalidArgument, "plan: no job file");
  return PrintPlans(specs, options);
}

}  // namespace lorastream::worker
