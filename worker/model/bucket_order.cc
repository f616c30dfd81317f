#include "worker/model/bucket_order.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "worker/model/model.h"

namespace lorastream::worker {

namespace {

std::vector<int64_t> Shuffled(std::vector<int64_t> v, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const at::Tensor perm = at::randperm(static_cast<int64_t>(v.size()), gen, at::kLong);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < perm.numel(); ++i) out.push_back(v[perm[i].item<int64_t>()]);
  return out;
}

}  // namespace

int64_t BucketBatchesPerEpoch(const std::vector<std::vector<int64_t>>& buckets,
                              int64_t batch_size) {
  int64_t n = 0;
  for (const auto& b : buckets) n += (static_cast<int64_t>(b.size()) + batch_size - 1) / batch_size;
  return n;
}

std::vector<int64_t> BucketBatch(const std::vector<std::vector<int64_t>>& buckets, int64_t step,
                                 int64_t batch_size, uint64_t seed) {
  const int64_t per_epoch = BucketBatchesPerEpoch(buckets, batch_size);
  const uint64_t epoch = static_cast<uint64_t>(step / per_epoch);
  std::vector<std::vector<int64_t>> batches;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const auto order = Shuffled(buckets[b], MixSeed(seed, 0xda7a, epoch, b));
    for (size_t i = 0; i < order.size(); i += static_cast<size_t>(batch_size))
      batches.emplace_back(order.begin() + static_cast<int64_t>(i),
                           order.begin() + static_cast<int64_t>(std::min(
                                               order.size(), i + static_cast<size_t>(batch_size))));
  }
  std::vector<int64_t> which(batches.size());
  for (size_t i = 0; i < which.size(); ++i) which[i] = static_cast<int64_t>(i);
  which = Shuffled(which, MixSeed(seed, 0xba7c, epoch));
  return batches[static_cast<size_t>(which[static_cast<size_t>(step % per_epoch)])];
}

}  // namespace lorastream::worker
