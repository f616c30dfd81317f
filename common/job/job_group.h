// Which jobs may train together in one job group (worker/train/group_trainer.h), torch-free so
// that the coordinator fills a worker's job slots by the rule the worker's group applies, and
// how many slots a worker has by default.
#pragma once

#include <cstdint>
#include <string>

#include "common/job/job_spec.h"

namespace lorastream {

// "" when `job` may train in a group with `first`, else the reason, naming the field
// (model.store, model.checkpoint, train.dtype, stream.*). FLUX.1 jobs group only with FLUX.1
// jobs of the same flux.store or flux.checkpoint, flux.dtype, flux.singles_per_unit and plan
// (flux.gpu_memory_budget, blocks_to_swap, ring_size). `device` resolves train.dtype "auto"
// (bf16 on CUDA, f32 on the CPU).
std::string GroupRefusal(const JobSpec& first, const JobSpec& job, const std::string& device);

// The job slots of a worker (`serve` without --jobs) whose device has `gpu_memory_bytes` (0: the
// CPU): 1 on the CPU; on a GPU one per kGiBPerJobSlot GiB, at least 1 and at most
// kMaxDefaultJobSlots. A group shares the weights and slots, but each job keeps its own
// activations, adapter and optimizer state, and the group's step takes every job's compute.
constexpr uint64_t kGiBPerJobSlot = 20;
constexpr int kMaxDefaultJobSlots = 4;
int DefaultJobSlots(uint64_t gpu_memory_bytes);

}  // namespace lorastream
