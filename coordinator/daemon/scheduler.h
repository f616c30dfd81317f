// The queue of jobs waiting for a worker: ordered by priority (higher first), then by
// submission (lower job id first). A job goes to a worker only when the worker's host has
// the job's base model: a store of that name and, once the job has run somewhere, the same
// fingerprint (a job resumed from a checkpoint must continue on the same base weights).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <utility>

namespace lorastream::coordinator {

class JobQueue {
 public:
  void Push(int64_t job_id, int32_t priority);
  void Remove(int64_t job_id, int32_t priority);
  bool empty() const { return order_.empty(); }
  size_t size() const { return order_.size(); }

  // The first job in queue order that `fits` accepts; 0 when none does.
  int64_t PickFirst(const std::function<bool(int64_t job_id)>& fits) const;

 private:
  std::set<std::pair<int64_t, int64_t>> order_;  // (-priority, job id)
};

}  // namespace lorastream::coordinator
