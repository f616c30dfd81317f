#include "worker/qwen_image/qwen_image_data.h"

#include <algorithm>
#include <map>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/qwen_image_cache.h"
#include "common/formats/safetensors.h"
#include "worker/model/base_weights.h"
#include "worker/model/bucket_order.h"
#include "worker/model/model.h"

namespace lorastream::worker::qwen_image {

namespace {

// A validated tensor of a cache file, as f32 (a copy).
at::Tensor ReadF32(const std::string& path, const std::string& key) {
  const SafetensorsFile f = SafetensorsFile::Open(path);
  const SafetensorsEntry* e = f.Find(key);
  LS_CHECK(e != nullptr, path + ": validated cache lacks " + key);
  return at::from_blob(const_cast<uint8_t*>(f.Data(*e)), e->shape,
                       at::TensorOptions().dtype(ScalarTypeOf(e->dtype, key)))
      .to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace

QwenImageDataset::QwenImageDataset(const std::string& cache_dir, const QwenImageConfig& config,
                                   bool edit) {
  // A bucket: the latent's (h, w), then each control's (musubi's buckets for edit caches).
  std::map<std::vector<int64_t>, std::vector<int64_t>> by_bucket;
  for (const QwenImageCacheItem& item : ScanQwenImageCache(cache_dir, edit)) {
    const QwenImageCacheCheck c =
        CheckQwenImageCache(item, config.out_channels, config.joint_attention_dim);
    Sample s{item.name,
             ReadF32(item.latents_path, c.latent_key).select(1, 0).contiguous(),
             ReadF32(item.te_path, c.embed_key),
             {}};
    std::vector<int64_t> bucket{c.latent_h, c.latent_w};
    for (size_t i = 0; i < c.control_keys.size(); ++i) {
      s.controls.push_back(ReadF32(item.latents_path, c.control_keys[i]).select(1, 0).contiguous());
      bucket.push_back(c.control_sizes[i].first);
      bucket.push_back(c.control_sizes[i].second);
    }
    bool finite =
        at::isfinite(s.latents).all().item<bool>() && at::isfinite(s.embeds).all().item<bool>();
    for (const at::Tensor& control : s.controls)
      finite = finite && at::isfinite(control).all().item<bool>();
    if (!finite)
      throw Error(ErrorCode::kCorrupt, item.name + ": a cache value is not finite (" +
                                           item.latents_path + ", " + item.te_path + ")");
    by_bucket[bucket].push_back(static_cast<int64_t>(samples_.size()));
    samples_.push_back(std::move(s));
  }
  for (auto& [bucket, indices] : by_bucket) {
    std::string controls;
    for (size_t i = 2; i + 1 < bucket.size(); i += 2)
      controls += (i == 2 ? ", controls " : " ") + std::to_string(bucket[i + 1]) + "x" +
                  std::to_string(bucket[i]);
    LS_LOG_INFO("Qwen-Image cache {}: bucket {}x{} (latent{}) holds {} images", cache_dir,
                bucket[1], bucket[0], controls, indices.size());
    buckets_.push_back(std::move(indices));
  }
}

std::pair<int64_t, int64_t> QwenImageDataset::largest_latent() const {
  return LargestLatent(samples_);
}

int64_t QwenImageDataset::max_text_tokens() const {
  int64_t n = 0;
  for (const auto& s : samples_) n = std::max(n, s.embeds.size(0));
  return n;
}

int64_t QwenImageDataset::batches_per_epoch(int64_t batch_size) const {
  return BucketBatchesPerEpoch(buckets_, batch_size);
}

QwenImageDataBatch QwenImageDataset::Batch(int64_t step, int64_t batch_size, uint64_t seed) const {
  QwenImageDataBatch out;
  std::vector<at::Tensor> lat;
  std::vector<std::vector<at::Tensor>> controls;  // per control index, each image's
  int64_t longest = 0;
  bool ragged = false;
  const std::vector<int64_t> chosen = BucketBatch(buckets_, step, batch_size, seed);
  for (int64_t i : chosen) {
    const Sample& s = samples_[static_cast<size_t>(i)];
    if (longest != 0 && s.embeds.size(0) != longest) ragged = true;
    longest = std::max(longest, s.embeds.size(0));
    lat.push_back(s.latents);
    controls.resize(s.controls.size());
    for (size_t k = 0; k < s.controls.size(); ++k) controls[k].push_back(s.controls[k]);
    out.names.push_back(s.name);
  }
  out.latents = at::stack(lat);
  for (const auto& control : controls) out.controls.push_back(at::stack(control));
  const int64_t n = static_cast<int64_t>(chosen.size());
  out.embeds = at::zeros({n, longest, samples_[static_cast<size_t>(chosen[0])].embeds.size(1)});
  if (ragged) out.txt_mask = at::zeros({n, longest}, at::kBool);
  for (int64_t j = 0; j < n; ++j) {
    const at::Tensor& e = samples_[static_cast<size_t>(chosen[static_cast<size_t>(j)])].embeds;
    out.embeds[j].narrow(0, 0, e.size(0)).copy_(e);
    if (ragged) out.txt_mask[j].narrow(0, 0, e.size(0)).fill_(true);
  }
  return out;
}

QwenImageStepInput MakeQwenImageStep(const QwenImageDataBatch& data, uint64_t seed, int64_t step,
                                     const dit::TimestepSampling& sampling, c10::Device device,
                                     c10::ScalarType dtype) {
  const int64_t n = data.latents.size(0), h = data.latents.size(2), w = data.latents.size(3);
  const dit::NoisedStep noised = dit::NoiseForStep(data.latents, seed, step, sampling);
  const dit::FlowMatch& fm = noised.fm;
  const at::Tensor& t = noised.t;
  QwenImageStepInput in;
  in.batch.img = dit::PackLatents(fm.noisy).to(device, dtype);
  in.batch.txt = data.embeds.to(device, dtype);
  if (data.txt_mask.defined()) in.batch.txt_mask = data.txt_mask.to(device);
  in.batch.timesteps = t.to(device);
  in.batch.grid_h = h / 2;
  in.batch.grid_w = w / 2;
  if (!data.controls.empty()) {
    std::vector<at::Tensor> packed;
    for (const at::Tensor& control : data.controls) {
      packed.push_back(dit::PackLatents(control));
      in.batch.control_grids.push_back({control.size(2) / 2, control.size(3) / 2});
    }
    in.batch.control = at::cat(packed, 1).to(device, dtype);
  }
  in.target = dit::PackLatents(fm.target).to(device);
  in.images = n;
  in.image_tokens = n * (h / 2) * (w / 2);
  return in;
}

}  // namespace lorastream::worker::qwen_image
