// A diffusion family's admission of the jobs that ask to join its running group
// (FamilyGroup::JoinRefusal): the group's estimated peak under its plan with every job
// (worker/stream/dit_plan.h), against the limit it was planned for. Each joiner's shape (its
// caches' headers) is read once per job file, as its submitter: a serving worker asks for every
// waiting job at every step.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/job/job_spec.h"
#include "worker/stream/dit_plan.h"

namespace lorastream {
struct UserIdentity;
}

namespace lorastream::worker {

class DitJoinAdmission {
 public:
  // `first`: the job the group was planned for, alone; `limit` (0: unknown, every job joins)
  // and `limit_what` name what the estimate is held against; `shape_of` reads a job's shape,
  // throwing where it cannot (the job then fails alone when it starts, naming its files).
  DitJoinAdmission(DitMemoryModel model, DitJob first, ResidencyPlan plan, uint64_t limit,
                   std::string limit_what, std::function<DitJob(const JobSpec&)> shape_of,
                   const UserIdentity* files_as);
  // "" when the group with `others` (a running group's jobs, then the one asking) fits; else
  // why, naming the last of them.
  std::string JoinRefusal(const std::vector<JobSpec>& others) const;

 private:
  const std::optional<DitJob>& ShapeOf(const JobSpec& spec) const;

  const DitMemoryModel model_;
  const DitJob first_;
  const ResidencyPlan plan_;
  const uint64_t limit_;
  const std::string limit_what_;
  const std::function<DitJob(const JobSpec&)> shape_of_;
  const UserIdentity* const files_as_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, std::optional<DitJob>> shapes_;  // by job file text
};

}  // namespace lorastream::worker
