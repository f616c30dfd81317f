// What a worker does before and after it runs a job for another user (README: Trust model):
// it opens no path of the job that the job's submitter could not open, and what it creates
// for the job belongs to the submitter. Torch-free.
#pragma once

#include <string>

#include "common/job_spec.h"
#include "common/user_access.h"

namespace lorastream {

// Throws Error(kRefused) naming the key, the path, the user and the component at fault when
// `who` may not read data.path or model.checkpoint, or may not write or create
// train.output_dir or train.stats_file (AccessProblem along every path component).
void CheckJobPathsAs(const JobSpec& spec, const UserIdentity& who);

// The topmost folder that creating `dir` (with its missing parents) would create, or `dir`
// itself when it exists: the root of what to hand over to the submitter afterwards.
std::string FirstMissingAncestor(const std::string& dir);

// A job's output folder is trained into by one job at a time: an exclusive lock on
// OUTPUT_DIR/.lorastream.lock, held while the job trains. `holder` describes the job ("job
// 7 attempt 1, worker w-2 pid 88"); a second job is refused (kRefused) naming the holder.
constexpr const char* kOutputDirLockName = ".lorastream.lock";

}  // namespace lorastream
