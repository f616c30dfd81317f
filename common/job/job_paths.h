// The one rule for the paths a job file holds: relative ones resolve against the job file's
// own folder, wherever the command that reads it runs; the job file's own path, given on a
// command line, stays relative to the current directory.
#pragma once

#include <string>

#include "common/job/job_spec.h"

namespace lorastream {

// `path` made absolute against `base_dir` ("" = the current directory) and normalised; ""
// stays "".
std::string ResolveJobPath(const std::string& path, const std::string& base_dir);

// The folder relative paths in the job file `job_path` resolve against: its own (absolute).
std::string JobFileDir(const std::string& job_path);

// ResolveJobSpec with the spec's paths resolved against `base_dir` (LoadJobSpec passes
// JobFileDir(path); "" = the current directory).
void ResolveJobSpecIn(JobSpec& spec, const std::string& base_dir);

}  // namespace lorastream
