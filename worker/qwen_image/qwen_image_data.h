// The training images of a Qwen-Image job: every image of a musubi-tuner cache folder
// (common/formats/qwen_image_cache.h) loaded once into host memory (f32), batched by bucket (latent
// size) in the order worker/model/bucket_order.h gives; captions of several lengths in one
// batch padded with zeros and masked, as musubi batches them. An edit job's images carry their
// control latents (musubi's Qwen-Image-Edit caches) and batch by their bucket and every
// control's size. And a step's model input: the batch noised at timesteps drawn from the job's
// seed and the step alone, the control latents clean after it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/qwen_image_config.h"
#include "worker/model/flow_match.h"
#include "worker/qwen_image/qwen_image_model.h"

namespace lorastream::worker::qwen_image {

struct QwenImageDataBatch {
  at::Tensor latents;   // [B, 16, h, w] f32
  at::Tensor embeds;    // [B, L_max, joint_dim] f32, zeros past each caption
  at::Tensor txt_mask;  // [B, L_max] bool; undefined when every caption has L_max tokens
  std::vector<at::Tensor> controls;  // an edit job's: per control image [B, 16, hc, wc] f32
  std::vector<std::string> names;
};

class QwenImageDataset {
 public:
  // The folder's _qi caches, or with `edit` its _qie caches and their control latents.
  // Refuses (naming the file and the tensor) anything ScanQwenImageCache and
  // CheckQwenImageCache refuse.
  QwenImageDataset(const std::string& cache_dir, const QwenImageConfig& config, bool edit = false);

  size_t size() const { return samples_.size(); }
  size_t buckets() const { return buckets_.size(); }
  // The largest latent (height, width) and the longest caption: the most tokens a step has.
  std::pair<int64_t, int64_t> largest_latent() const;
  int64_t max_text_tokens() const;
  int64_t batches_per_epoch(int64_t batch_size) const;
  // The batch of step `step` (0-based).
  QwenImageDataBatch Batch(int64_t step, int64_t batch_size, uint64_t seed) const;

 private:
  struct Sample {
    std::string name;
    at::Tensor latents, embeds;        // [16, h, w], [L, joint_dim]
    std::vector<at::Tensor> controls;  // [16, hc, wc] each
  };
  std::vector<Sample> samples_;
  std::vector<std::vector<int64_t>> buckets_;
};

// A step's input and target: noise and t from a generator seeded by (seed, step), t drawn by
// `sampling` (SampleTimesteps), the noisy latents packed 2x2 into the model's batch on
// `device` in `dtype` (the mask and timesteps as they are), the target noise - x packed (f32);
// an edit batch's control latents packed likewise, each image's after the previous one's.
struct QwenImageStepInput {
  QwenImageBatch batch;
  at::Tensor target;
  int64_t images = 0, image_tokens = 0;  // the target images' (the loss's) tokens
};
QwenImageStepInput MakeQwenImageStep(const QwenImageDataBatch& data, uint64_t seed, int64_t step,
                                     const dit::TimestepSampling& sampling, c10::Device device,
                                     c10::ScalarType dtype);

}  // namespace lorastream::worker::qwen_image
