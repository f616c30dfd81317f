#include "worker/flux/flux_data.h"

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "worker/model/bucket_order.h"

namespace lorastream::worker::flux {

namespace {

at::Tensor FromFloats(const std::vector<float>& v, std::vector<int64_t> shape) {
  return at::from_blob(const_cast<float*>(v.data()), shape, at::kFloat).clone();
}

}  // namespace

FluxDataset::FluxDataset(const std::string& cache_dir, const FluxConfig& config) {
  const auto items = ScanFluxCache(cache_dir);
  int64_t txt_len = -1;
  std::string first_te;
  for (const auto& [bucket, list] : FluxBuckets(items)) {
    std::vector<int64_t> indices;
    for (const auto& item : list) {
      const FluxSample s =
          LoadFluxSample(item, config.in_channels / 4, config.context_in_dim, config.vec_in_dim);
      if (txt_len < 0) {
        txt_len = s.txt_len;
        first_te = item.te_path;
      } else if (s.txt_len != txt_len) {
        throw Error(
            ErrorCode::kCorrupt,
            item.te_path + ": " + std::to_string(s.txt_len) + " text tokens, while " + first_te +
                " has " + std::to_string(txt_len) +
                " (cache every caption at one T5 length, sd-scripts' t5xxl_max_token_length)");
      }
      indices.push_back(static_cast<int64_t>(samples_.size()));
      samples_.push_back({item.name, FromFloats(s.latents, {s.channels, s.latent_h, s.latent_w}),
                          FromFloats(s.t5_out, {s.txt_len, s.context_dim}),
                          FromFloats(s.txt_ids, {s.txt_len, 3}),
                          FromFloats(s.l_pooled, {s.vec_dim})});
    }
    LS_LOG_INFO("FLUX cache {}: bucket {}x{} holds {} images", cache_dir, bucket.second,
                bucket.first, indices.size());
    buckets_.push_back(std::move(indices));
  }
}

int64_t FluxDataset::batches_per_epoch(int64_t batch_size) const {
  return BucketBatchesPerEpoch(buckets_, batch_size);
}

FluxDataBatch FluxDataset::Batch(int64_t step, int64_t batch_size, uint64_t seed) const {
  const std::vector<int64_t> chosen = BucketBatch(buckets_, step, batch_size, seed);
  FluxDataBatch out;
  std::vector<at::Tensor> lat, t5, ids, pooled;
  for (int64_t i : chosen) {
    const Sample& s = samples_[static_cast<size_t>(i)];
    lat.push_back(s.latents);
    t5.push_back(s.t5);
    ids.push_back(s.txt_ids);
    pooled.push_back(s.pooled);
    out.names.push_back(s.name);
  }
  out.latents = at::stack(lat);
  out.t5 = at::stack(t5);
  out.txt_ids = at::stack(ids);
  out.pooled = at::stack(pooled);
  return out;
}

std::pair<int64_t, int64_t> FluxDataset::largest_latent() const { return LargestLatent(samples_); }

int64_t FluxDataset::text_tokens() const { return samples_.empty() ? 0 : samples_[0].t5.size(0); }

}  // namespace lorastream::worker::flux
