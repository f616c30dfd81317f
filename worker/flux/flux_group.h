// FLUX.1 job groups: the one group trainer (worker/train/group_trainer.h) with FLUX.1's family
// (worker/flux/flux_family.h). What a group's jobs share and what is each job's own is said
// there; two FLUX jobs may share a group when they share the base (flux.store, or
// flux.checkpoint with flux.singles_per_unit), flux.dtype and the plan (flux.gpu_memory_budget,
// blocks_to_swap, ring_size): GroupRefusal (common/job/job_group.h) refuses a job that differs,
// naming the key. A job trained in a group computes what it computes alone (bit for bit on the
// CPU: its units run on its own rows only).
#pragma once

#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "common/job/flux_job.h"
#include "common/job/job_spec.h"
#include "worker/flux/flux_calibrate.h"
#include "worker/train/group_trainer.h"

namespace lorastream::worker::flux {

class FluxBase;

using FluxGroupTrainer = GroupTrainer;

// A JobSpec of the FLUX job `job` (is_flux, its base and output mirrored) named `name`.
JobSpec FluxJobSpec(const FluxJob& job, const std::string& name);

// RunGroupTraining for FLUX jobs (the plan leaves room for every job).
inline std::vector<GroupJobOutcome> RunFluxGroupTraining(std::vector<GroupJob> jobs,
                                                         const TrainOptions& options) {
  return RunGroupTraining(std::move(jobs), options);
}

// The other jobs a budget plans for (or, with `always`, a plan predicts for): each one's memory
// at its own shape, and its measured costs when planning asks (a group that does not stack).
FluxPlanGroup FluxPlanGroupOf(const FluxBase& base, const JobSpec& first,
                              const std::vector<JobSpec>& others, c10::Device device,
                              c10::ScalarType dtype, bool always = false);

// A group member's part of the memory estimate, from its own inputs.
FluxGroupMember FluxMemberOf(const std::string& name, const FluxMemoryInputs& in);
// The members `specs` (their caches read for their largest buckets), for the memory estimate
// only (no costs measured).
std::vector<FluxGroupMember> FluxMembersOf(const FluxBase& base, const std::vector<JobSpec>& specs,
                                           c10::Device device, c10::ScalarType dtype);

// `lorastream-worker plan A.toml B.toml ...` on FLUX jobs: the group's plans (the first job's
// table with every job's memory and measured compute); jobs that cannot share a group are
// refused naming the key.
int RunFluxGroupPlanCommand(const std::vector<std::string>& job_paths, const std::string& device);

}  // namespace lorastream::worker::flux
