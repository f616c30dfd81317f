#include "worker/qwen_image/qwen_image_plan.h"

#include <algorithm>
#include <tuple>

#include "common/formats/qwen_image_cache.h"

namespace lorastream::worker::qwen_image {

DitMemoryModel QwenImageMemoryModel(const QwenImageMemoryInputs& in) {
  const QwenImageConfig& c = in.config;
  const uint64_t b = static_cast<uint64_t>(in.compute_bytes);
  const uint64_t d = static_cast<uint64_t>(c.hidden()), m = static_cast<uint64_t>(c.mlp_hidden());
  DitMemoryModel out;
  out.kind_names = {"blocks"};
  out.unit_kind.assign(in.block_bytes.size(), 0);
  out.unit_bytes = in.block_bytes;
  out.expanded_bytes = in.expanded_bytes;
  out.rest_bytes = in.rest_bytes;
  out.reserve_bytes = in.reserve_bytes;
  out.checkpoint_per_token = in.block_bytes.size() * d * b;
  out.table_per_token = static_cast<uint64_t>(c.head_dim) * 8;
  out.table_per_latent = false;  // QwenRopeTable: [1, 1, T, head_dim / 2, 2, 2]
  out.forward_per_token = DualStreamForwardPerToken(d, m, b, in.fused_heads);
  out.backward_per_token.assign(in.block_bytes.size(),
                                DualStreamBackwardPerToken(d, m, b, in.fused_heads));
  // Taped: a block's token-wise linears are to_q, to_k, to_v, to_out.0 and the MLP's two (or
  // their text-stream twins).
  out.tape_per_token.assign(
      in.block_bytes.size(),
      DualStreamTapePerToken(d, m, b, static_cast<uint64_t>(c.num_heads), in.fused_heads));
  out.tape_lora.assign(in.block_bytes.size(), 6 * b);
  out.tape_attentions.assign(in.block_bytes.size(), 1);
  out.stream_grads_per_token = 2 * d * b;
  out.heads = c.num_heads;
  out.score_bytes = in.attention_materialized ? 3 * b : 0;
  out.group_stacked = in.group_stacked;
  out.budget_key = "stream.gpu_memory_budget";
  out.batch_key = "train.batch_size";
  out.family = "Qwen-Image";
  return out;
}

DitMemoryEstimate EstimateQwenImageMemory(const QwenImageMemoryInputs& in,
                                          const ResidencyPlan& plan) {
  return EstimateDitMemory(QwenImageMemoryModel(in), in.job, in.group, plan);
}

int64_t QwenImageLoraParams(const QwenImageConfig& config, const std::vector<std::string>& targets,
                            int64_t rank) {
  int64_t n = 0;
  const TensorShapes shapes = QwenImageBlockShapes(config);
  for (const auto& t : targets)
    for (const auto& [name, shape] : shapes)
      if (name == t + ".weight") n += config.num_layers * rank * (shape[0] + shape[1]);
  return n;
}

std::pair<int64_t, int64_t> QwenImageCacheTokens(const std::string& dir,
                                                 const QwenImageConfig& config, bool edit) {
  int64_t image = 0, text = 0;
  const int64_t p = config.patch_size;
  for (const QwenImageCacheItem& item : ScanQwenImageCache(dir, edit)) {
    const QwenImageCacheCheck c =
        CheckQwenImageCache(item, config.out_channels, config.joint_attention_dim);
    int64_t tokens = (c.latent_h / p) * (c.latent_w / p);
    for (const auto& [h, w] : c.control_sizes) tokens += (h / p) * (w / p);
    image = std::max(image, tokens);
    text = std::max(text, c.txt_len);
  }
  return {image, text};
}

DitJob QwenImageDitJob(const JobSpec& spec, const QwenImageConfig& config) {
  DitJob job;
  job.name = spec.name;
  job.lora_params = QwenImageLoraParams(
      config, QwenImageTargets(spec.lora.targets, spec.source + ": key `lora.targets`"),
      spec.lora.rank);
  job.lora_rank = spec.lora.rank;
  job.eight_bit_optimizer = spec.optim.type == "adamw8bit";
  job.batch = spec.train.batch_size;
  std::tie(job.image_tokens, job.text_tokens) =
      QwenImageCacheTokens(spec.qwen_image.cache_dir, config, spec.qwen_image.edit);
  return job;
}

PlanChoice ChooseQwenImagePlan(const QwenImageMemoryInputs& in, const StepCosts& costs,
                               uint64_t budget_bytes, int max_ring) {
  return ChooseDitPlan(QwenImageMemoryModel(in), in.job, in.group, costs, budget_bytes, max_ring);
}

std::string QwenImageGroupBudgetRefusal(const QwenImageMemoryInputs& in, uint64_t budget_bytes) {
  return DitGroupBudgetRefusal(QwenImageMemoryModel(in), in.job, in.group, budget_bytes);
}

}  // namespace lorastream::worker::qwen_image
