#include "coordinator/daemon/scheduler.h"

namespace lorastream::coordinator {

void JobQueue::Push(int64_t job_id, int32_t priority) {
  order_.emplace(-static_cast<int64_t>(priority), job_id);
}

void JobQueue::Remove(int64_t job_id, int32_t priority) {
  order_.erase({-static_cast<int64_t>(priority), job_id});
}

int64_t JobQueue::PickFirst(const std::function<bool(int64_t job_id)>& fits) const {
  for (const auto& [neg_priority, id] : order_)
    if (fits(id)) return id;
  return 0;
}

}  // namespace lorastream::coordinator
