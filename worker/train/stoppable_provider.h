// A job group's BlockProvider that a stop asked by every job interrupts between two blocks
// (GroupTrainer's and flux::FluxGroupTrainer's): the group then leaves each job at its last
// completed step, with a checkpoint.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "common/base/error.h"
#include "worker/model/block_provider.h"

namespace lorastream::worker {

// The group's provider, asking should_stop before every block it hands out: a stop (cancel,
// SIGTERM) asked in the middle of a long step ends it at the next block, within seconds,
// instead of after the step. Acquire then throws; stopped() tells the trainer why the step
// failed. A step captured as a CUDA graph (host-only acquisition on a GPU) is never
// interrupted mid-capture: it stops at the step boundary.
class StoppableProvider final : public BlockProvider {
 public:
  StoppableProvider(std::unique_ptr<BlockProvider> inner, std::function<bool()> should_stop,
                    bool cuda)
      : inner_(std::move(inner)),
        should_stop_(std::move(should_stop)),
        poll_(should_stop_ && !(cuda && inner_->step_is_host_only())) {}
  int num_blocks() const override { return inner_->num_blocks(); }
  void BeginStep() override { inner_->BeginStep(); }
  const BlockWeights& Acquire(int block) override {
    if (poll_ && should_stop_()) {
      stopped_ = true;
      throw Error(ErrorCode::kCancelled, "stopped before block " + std::to_string(block));
    }
    return inner_->Acquire(block);
  }
  void Release(int block) override { inner_->Release(block); }
  void EndStep(StepStats& stats) override { inner_->EndStep(stats); }
  HeadProvider* lm_head() override { return inner_->lm_head(); }
  int taped_blocks() const override { return inner_->taped_blocks(); }
  bool step_is_host_only() const override { return inner_->step_is_host_only(); }
  std::string JoinRefusal(const std::vector<JobSpec>& others) const override {
    return inner_->JoinRefusal(others);
  }
  bool stopped() const { return stopped_; }

 private:
  std::unique_ptr<BlockProvider> inner_;
  std::function<bool()> should_stop_;
  const bool poll_;
  bool stopped_ = false;
};

}  // namespace lorastream::worker
