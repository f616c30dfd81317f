// `lorastream-worker plan JOB.toml --device DEV`: the swap plans the cost model considers for
// the job, each with its predicted step time, copied bytes and estimated peak, and the one it
// chooses. The budget is the job's stream.gpu_memory_budget ("auto" on a GPU: the share of
// its free memory JobMemoryBudget takes); without one, the estimated peak
// of the job's own plan (blocks_to_swap, ring_size), so the table shows what the same memory
// buys. Calibrates on DEV first (or reads the cached figures).
#pragma once

#include <string>
#include <vector>

#include "worker/train/plan_options.h"

namespace lorastream::worker {

// Prints to stdout; returns the exit code (0). Errors are thrown (lorastream::Error).
int RunPlanCommand(const std::string& job_path, const PlanCommandOptions& options);

// `lorastream-worker plan A.toml B.toml ...`: the plans of a job group (worker/train/
// group_trainer.h), planned from the first job's [stream] with the memory estimate covering
// every job's activations, tapes, adapter and optimizer state beside one set of slots. Each
// job's line, then RunPlanCommand's table for the group. Refuses (Error kRefused) a job that
// cannot share the group (naming the field), and a group that does not fit its budget under
// its smallest plan, naming the job that does not fit and by how much. The predicted step
// times are the first job's alone (the cost model is calibrated per job).
int RunPlanCommand(const std::vector<std::string>& job_paths, const PlanCommandOptions& options);

}  // namespace lorastream::worker
