// The jobs of a job group and the outcomes of those that left, for the groups of every family
// (GroupTrainer, flux::FluxGroupTrainer): a job joins at a step boundary or leaves at once with
// the error that kept it from starting, leaves with its result or its own failure (logged as
// its own), and the group reports the leavers in the order they left. Torch-free.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/base/error.h"
#include "common/base/log.h"
#include "worker/train/group_trainer.h"

namespace lorastream::worker {

// What a job's failure says.
inline std::string FailureMessage(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return WithoutBacktrace(e.what());  // LibTorch's backtrace is not what went wrong
  } catch (...) {
    return "an unknown error";
  }
}

// Job: has name(), index(), result() (a TrainResult) and StopRequested().
template <class Job>
class GroupMembers {
 public:
  // `kind` names the group in its log ("group", "FLUX group"); on_change runs after a job
  // joins and before one that leaves is destroyed (a group dropping what reads its tensors).
  explicit GroupMembers(std::string kind, std::function<void()> on_change = {})
      : kind_(std::move(kind)), on_change_(std::move(on_change)) {}
  ~GroupMembers() { jobs_.clear(); }

  // The job `make(index)` builds joins; one that cannot be built leaves at once with the
  // error. Returns its index (the order of Add calls).
  template <class Make>
  size_t Add(const std::string& name, Make&& make) {
    const size_t index = added_++;
    try {
      jobs_.push_back(make(index));
      if (on_change_) on_change_();
      LS_LOG_INFO("job {}: joins the {} ({} job{})", name, kind_, jobs_.size(),
                  jobs_.size() == 1 ? "" : "s");
    } catch (...) {
      GroupJobOutcome out;
      out.name = name;
      out.index = index;
      out.error = std::current_exception();
      left_.push_back(std::move(out));
    }
    return index;
  }

  // The job at `position` leaves, failed when `error` is set.
  void Leave(size_t position, std::exception_ptr error) {
    Job& job = *jobs_[position];
    GroupJobOutcome out;
    out.name = job.name();
    out.index = job.index();
    out.result = job.result();
    out.error = error;
    if (error)
      LS_LOG_WARN("job {}: failed, leaving the group: {}", job.name(), FailureMessage(error));
    left_.push_back(std::move(out));
    if (on_change_) on_change_();
    jobs_.erase(jobs_.begin() + static_cast<int64_t>(position));
  }

  // Every job, in order, through `f(job)`: one for which it returns true leaves, one for which
  // it throws leaves failed with that error.
  template <class F>
  void Sweep(F&& f) {
    for (size_t p = 0; p < jobs_.size();) {
      bool leaves = false;
      std::exception_ptr error;
      try {
        leaves = f(*jobs_[p]);
      } catch (...) {
        leaves = true;
        error = std::current_exception();
      }
      if (leaves)
        Leave(p, error);
      else
        ++p;
    }
  }

  // A failure of the group's shared work: every job leaves with it.
  void LeaveAll(std::exception_ptr error) {
    while (!jobs_.empty()) Leave(jobs_.size() - 1, error);
  }

  // Whether every job asks to stop (Job::StopRequested): the group's step may end between
  // two blocks (worker/train/stoppable_provider.h).
  bool AllStopRequested() const {
    if (jobs_.empty()) return false;
    for (const auto& job : jobs_)
      if (!job->StopRequested()) return false;
    return true;
  }

  std::vector<GroupJobOutcome> TakeLeft() { return std::exchange(left_, {}); }
  const std::vector<std::unique_ptr<Job>>& jobs() const { return jobs_; }
  size_t size() const { return jobs_.size(); }
  bool empty() const { return jobs_.empty(); }

 private:
  std::string kind_;
  std::function<void()> on_change_;
  std::vector<std::unique_ptr<Job>> jobs_;
  std::vector<GroupJobOutcome> left_;
  size_t added_ = 0;
};

}  // namespace lorastream::worker
