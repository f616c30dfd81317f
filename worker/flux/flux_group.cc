// FLUX.1 groups' plans (worker/flux/flux_group.h).
#include "worker/flux/flux_group.h"

#include <cstdio>
#include <memory>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/base/error.h"
#include "common/job/job_group.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_data.h"
#include "worker/model/torch_device.h"
#include "worker/train/stream_provider.h"

namespace lorastream::worker::flux {

JobSpec FluxJobSpec(const FluxJob& job, const std::string& name) {
  JobSpec spec;
  spec.name = name;
  spec.is_flux = true;
  spec.flux = job;
  MirrorFluxJob(spec);
  return spec;
}

FluxPlanGroup FluxPlanGroupOf(const FluxBase& base, const JobSpec& first,
                              const std::vector<JobSpec>& others, c10::Device device,
                              c10::ScalarType dtype, bool always) {
  FluxPlanGroup group;
  group.first_name = first.name;
  if (others.empty() || (!always && JobMemoryBudget(first.flux.gpu_memory_budget,
                                                    first.flux.budget_auto, device) == 0))
    return group;
  // Each member's caches are read once, for its memory now and its costs if asked.
  struct Member {
    FluxJob job;
    std::shared_ptr<const FluxDataset> data;
    FluxMemoryInputs in;
  };
  std::vector<Member> members;
  for (const JobSpec& spec : others) {
    Member m;
    m.job = spec.flux;
    m.job.singles_per_unit = base.singles_per_unit();
    m.data = std::make_shared<const FluxDataset>(m.job.cache_dir, base.config());
    m.in = FluxMemoryInputsFor(base, m.job, *m.data, device, dtype);
    group.members.push_back(FluxMemberOf(spec.name, m.in));
    members.push_back(std::move(m));
  }
  group.member_costs = [&base, members = std::move(members), device, dtype] {
    std::vector<StepCosts> costs;
    for (const Member& m : members)
      costs.push_back(MeasureFluxCosts(base, m.job, m.in, *m.data, device, dtype));
    return costs;
  };
  return group;
}

FluxGroupMember FluxMemberOf(const std::string& name, const FluxMemoryInputs& in) {
  return {name,         in.lora_params,        in.batch, in.image_tokens, in.text_tokens,
          in.lora_rank, in.eight_bit_optimizer};
}

std::vector<FluxGroupMember> FluxMembersOf(const FluxBase& base, const std::vector<JobSpec>& specs,
                                           c10::Device device, c10::ScalarType dtype) {
  std::vector<FluxGroupMember> out;
  for (const JobSpec& spec : specs) {
    FluxJob job = spec.flux;
    job.singles_per_unit = base.singles_per_unit();
    const FluxDataset data(job.cache_dir, base.config());
    out.push_back(FluxMemberOf(spec.name, FluxMemoryInputsFor(base, job, data, device, dtype)));
  }
  return out;
}

int RunFluxGroupPlanCommand(const std::vector<std::string>& job_paths,
                            const std::string& device_name) {
  std::vector<JobSpec> specs;
  for (const std::string& path : job_paths) {
    specs.push_back(LoadJobSpec(path));
    const std::string why = GroupRefusal(specs.front(), specs.back(), device_name);
    if (!why.empty()) throw Error(ErrorCode::kRefused, path + ": " + why);
  }
  at::set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  const c10::Device device = TorchDevice(ParseDevice(device_name));
  FluxJob job = specs.front().flux;
  const c10::ScalarType dtype = job.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const FluxBase base = FluxBase::ForJob(job, dtype, device);
  job.singles_per_unit = base.singles_per_unit();
  const FluxDataset data(job.cache_dir, base.config());
  const std::vector<JobSpec> others(specs.begin() + 1, specs.end());
  const FluxPlanning p =
      PlanFluxJob(base, job, data, device, dtype, /*predict=*/true,
                  FluxPlanGroupOf(base, specs.front(), others, device, dtype, /*always=*/true));
  std::printf("a group of %zu FLUX jobs (%s and %zu more): every job's memory and compute\n%s",
              specs.size(), specs.front().name.c_str(), others.size(),
              DescribeFluxPlanning(p).c_str());
  return 0;
}

}  // namespace lorastream::worker::flux
