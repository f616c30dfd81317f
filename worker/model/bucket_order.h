// The order in which a diffusion job's images are trained, a function of the job's seed
// alone: each epoch shuffles every bucket's images (a bucket: images of one resolution), cuts
// them into batches of one bucket, and shuffles the batches.
#pragma once

#include <cstdint>
#include <vector>

namespace lorastream::worker {

// Batches of one epoch over `buckets` (sample indices per bucket).
int64_t BucketBatchesPerEpoch(const std::vector<std::vector<int64_t>>& buckets, int64_t batch_size);
// The sample indices of step `step`'s batch (0-based).
std::vector<int64_t> BucketBatch(const std::vector<std::vector<int64_t>>& buckets, int64_t step,
                                 int64_t batch_size, uint64_t seed);

}  // namespace lorastream::worker
