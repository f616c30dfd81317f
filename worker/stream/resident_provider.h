// The fully resident BlockProvider: every block converted once to the compute device and
// dtype (on the CPU with a matching dtype these are the base's zero-copy views). Acquire and
// Release only check that the trainer keeps the step's order; on CUDA every step reports the
// caching allocator's peak (peak_device_bytes), as the streaming engine does.
#pragma once

#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "worker/model/base_weights.h"
#include "worker/model/block_provider.h"

namespace lorastream::worker {

class ResidentProvider : public BlockProvider {
 public:
  ResidentProvider(const BaseWeights& base, c10::Device device, c10::ScalarType dtype);

  int num_blocks() const override { return static_cast<int>(blocks_.size()); }
  void BeginStep() override;
  const BlockWeights& Acquire(int block) override;
  void Release(int block) override;
  void EndStep(StepStats& stats) override;

  // Acquire calls since construction (tests check the step's order through it).
  const std::vector<int>& acquire_log() const { return acquire_log_; }
  void set_record_acquires(bool on) { record_ = on; }
  // Resident blocks can keep their activations too (BlockProvider::taped_blocks).
  int taped_blocks() const override { return taped_blocks_; }
  void set_taped_blocks(int k) { taped_blocks_ = k; }
  bool step_is_host_only() const override { return true; }

 private:
  std::vector<BlockWeights> blocks_;
  int cuda_index_ = -1;  // the CUDA device whose peak memory EndStep reports; -1: not CUDA
  int held_ = -1;        // the block between Acquire and Release, -1 when none
  bool record_ = false;
  int taped_blocks_ = 0;
  std::vector<int> acquire_log_;
};

}  // namespace lorastream::worker
