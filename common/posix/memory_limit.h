// A job whose estimated peak memory exceeds what its device has is refused when it starts,
// before it allocates anything (README: Trust model): a GPU's memory, or on the CPU the
// host's. Torch-free; the worker's streaming planner supplies the estimate.
#pragma once

#include <cstdint>
#include <string>

namespace lorastream {

// The host's physical memory in bytes (what a job on the CPU can have at most).
uint64_t HostMemoryBytes();

// "" when `estimate` fits in `limit`; otherwise the refusal, naming both and `device`
// ("cpu (the host's memory)", "cuda:0") and the job keys that lower the estimate.
std::string MemoryLimitProblem(uint64_t estimate, uint64_t limit, const std::string& device);

// "" when a running group's estimated peak with a job joining it, `estimate`, fits `limit`
// (`limit_what`: "the budget (gpu_memory_budget)", "the host's memory (cpu)"); otherwise why job
// `joiner` cannot join the group's `others` other jobs now (it trains once the group drains).
std::string GroupJoinProblem(const std::string& joiner, size_t others, uint64_t estimate,
                             uint64_t limit, const std::string& limit_what);

}  // namespace lorastream
