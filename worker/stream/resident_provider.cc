#include "worker/stream/resident_provider.h"

#include <ATen/ATen.h>

#include "common/base/error.h"
#ifdef LORASTREAM_HAVE_CUDA
#include "worker/stream/cuda/cuda_memory.h"
#endif

namespace lorastream::worker {

ResidentProvider::ResidentProvider(const BaseWeights& base, c10::Device device,
                                   c10::ScalarType dtype) {
  for (int i = 0; i < base.num_blocks(); ++i)
    blocks_.push_back(ConvertBlock(base.block(i), device, dtype));
  if (device.is_cuda()) cuda_index_ = device.has_index() ? device.index() : 0;
}

void ResidentProvider::BeginStep() {
  held_ = -1;
#ifdef LORASTREAM_HAVE_CUDA
  if (cuda_index_ >= 0) CudaResetPeakAllocated(cuda_index_);
#endif
}

const BlockWeights& ResidentProvider::Acquire(int block) {
  LS_CHECK(block >= 0 && block < num_blocks(), "Acquire of block " + std::to_string(block));
  LS_CHECK(held_ == -1, "Acquire(" + std::to_string(block) + ") while block " +
                            std::to_string(held_) + " is still held");
  held_ = block;
  if (record_) acquire_log_.push_back(block);
  return blocks_[block];
}

void ResidentProvider::Release(int block) {
  LS_CHECK(held_ == block, "Release(" + std::to_string(block) + ") of a block not acquired");
  held_ = -1;
}

void ResidentProvider::EndStep(StepStats& stats) {
  stats.h2d_bytes = 0;
  stats.copies = 0;
  stats.copies_saved = 0;
#ifdef LORASTREAM_HAVE_CUDA
  if (cuda_index_ >= 0) stats.peak_device_bytes = CudaPeakAllocatedBytes(cuda_index_);
#endif
}

}  // namespace lorastream::worker
