// The families this worker trains, a row each (families.cc). The one trainer reaches them
// through worker/train/family.h (FamilyName, MakeFamilyGroup); the commands through here.
#pragma once

#include <string>
#include <vector>

#include "worker/serve/plan_command.h"

namespace lorastream::worker {

// `lorastream-worker plan A.toml [B.toml ...]`: the plan of the jobs' family (every job of one
// family, else refused naming the file).
int RunFamilyPlanCommand(const std::vector<std::string>& job_paths,
                         const PlanCommandOptions& options);

// Refuses (Error kInvalidArgument, naming the file) job files of more than one family: a group
// trains one family on one base.
void RequireOneFamily(const std::vector<std::string>& job_paths);

}  // namespace lorastream::worker
