// The order in which a diffusion job's images are trained, a function of the job's seed
// alone: each epoch shuffles every bucket's images (a bucket: images of one resolution), cuts
// them into batches of one bucket, and shuffles the batches. And the largest image of a
// dataset's samples.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace lorastream::worker {

// Batches of one epoch over `buckets` (sample indices per bucket).
int64_t BucketBatchesPerEpoch(const std::vector<std::vector<int64_t>>& buckets, int64_t batch_size);
// The sample indices of step `step`'s batch (0-based).
std::vector<int64_t> BucketBatch(const std::vector<std::vector<int64_t>>& buckets, int64_t step,
                                 int64_t batch_size, uint64_t seed);

// The largest of `samples`' latents (each sample's `latents` [C, h, w], an at::Tensor) by
// area, as (h, w); (0, 0) for none: a diffusion dataset's most image tokens in a step.
template <class Sample>
std::pair<int64_t, int64_t> LargestLatent(const std::vector<Sample>& samples) {
  std::pair<int64_t, int64_t> out{0, 0};
  for (const Sample& s : samples)
    if (s.latents.size(1) * s.latents.size(2) > out.first * out.second)
      out = {s.latents.size(1), s.latents.size(2)};
  return out;
}

}  // namespace lorastream::worker
