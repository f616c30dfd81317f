// The training images of a FLUX job: every sample of a cache folder (common/formats/flux_cache.h)
// loaded once into host memory, batched by bucket. The order is a function of the job's seed
// alone: each epoch shuffles every bucket's images, cuts them into batches of one bucket,
// and shuffles the batches.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/formats/flux_cache.h"
#include "common/formats/flux_config.h"

namespace lorastream::worker::flux {

struct FluxDataBatch {
  at::Tensor latents;  // [B, 16, h, w] f32
  at::Tensor t5;       // [B, L, context_in_dim] f32
  at::Tensor txt_ids;  // [B, L, 3] f32
  at::Tensor pooled;   // [B, vec_in_dim] f32
  std::vector<std::string> names;
};

class FluxDataset {
 public:
  // Refuses (naming the file) anything LoadFluxSample refuses, and text of another length
  // than the others (their batches would not stack).
  FluxDataset(const std::string& cache_dir, const FluxConfig& config);

  size_t size() const { return samples_.size(); }
  size_t buckets() const { return buckets_.size(); }
  // The largest image's latent size (its height and width; the most image tokens a step has)
  // and the text tokens per caption (every caption has as many).
  std::pair<int64_t, int64_t> largest_latent() const;
  int64_t text_tokens() const;
  // Batches of one epoch.
  int64_t batches_per_epoch(int64_t batch_size) const;
  // The batch of step `step` (0-based).
  FluxDataBatch Batch(int64_t step, int64_t batch_size, uint64_t seed) const;

 private:
  struct Sample {
    std::string name;
    at::Tensor latents, t5, txt_ids, pooled;
  };
  std::vector<Sample> samples_;
  std::vector<std::vector<int64_t>> buckets_;  // sample indices per bucket
};

}  // namespace lorastream::worker::flux
