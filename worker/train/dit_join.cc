#include "worker/train/dit_join.h"

#include <exception>
#include <utility>

#include "common/posix/acting_as.h"
#include "common/posix/memory_limit.h"

namespace lorastream::worker {

DitJoinAdmission::DitJoinAdmission(DitMemoryModel model, DitJob first, ResidencyPlan plan,
                                   uint64_t limit, std::string limit_what,
                                   std::function<DitJob(const JobSpec&)> shape_of,
                                   const UserIdentity* files_as)
    : model_(std::move(model)),
      first_(std::move(first)),
      plan_(std::move(plan)),
      limit_(limit),
      limit_what_(std::move(limit_what)),
      shape_of_(std::move(shape_of)),
      files_as_(files_as) {}

std::string DitJoinAdmission::JoinRefusal(const std::vector<JobSpec>& others) const {
  if (others.empty() || limit_ == 0) return "";
  std::vector<DitJob> group;
  for (const JobSpec& spec : others)
    if (const std::optional<DitJob>& shape = ShapeOf(spec)) group.push_back(*shape);
  return GroupJoinProblem(others.back().name, others.size(),
                          EstimateDitMemory(model_, first_, group, plan_).total(), limit_,
                          limit_what_);
}

const std::optional<DitJob>& DitJoinAdmission::ShapeOf(const JobSpec& spec) const {
  const std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = JobSpecToToml(spec);
  auto it = shapes_.find(key);
  if (it != shapes_.end()) return it->second;
  std::optional<DitJob> shape;
  try {
    const ActingAs as(files_as_);
    shape = shape_of_(spec);
  } catch (const std::exception&) {
  }
  return shapes_.emplace(key, std::move(shape)).first->second;
}

}  // namespace lorastream::worker
