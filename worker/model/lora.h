// The LoRA adapter: per block and per target module a pair A [r, in], B [out, r] of fp32
// master weights (the only trainable tensors), scale alpha/r (alpha/sqrt(r) with rsLoRA),
// initialised as peft does by default (A kaiming_uniform(a=sqrt(5)), B zeros), and saved /
// loaded exactly in peft's format (adapter_model.safetensors + adapter_config.json).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/formats/model_config.h"
#include "worker/model/lora_settings.h"

namespace lorastream::worker {

// Per-block adapter tensors; undefined where the projection is not targeted. In a mixture of
// experts (ModelConfig::is_moe) the MLP targets (gate_proj, up_proj, down_proj) are each
// expert's: `experts[e]` holds them ({gate, up, down}) and a/b[kGateProj..kDownProj] stay
// undefined.
struct ExpertLora {
  std::array<at::Tensor, 3> a, b;
};
struct LoraBlock {
  std::array<at::Tensor, kNumLoraTargets> a, b;
  std::vector<ExpertLora> experts;
};

// One (A, B) pair of a block's adapter: its module relative to "model.layers.{i}."
// ("self_attn.q_proj", "mlp.experts.3.gate_proj", "block_sparse_moe.experts.0.w1"), A's
// [r, in] and B's [out, r] sizes, and where its tensors are.
struct LoraSlot {
  std::string module;
  int64_t in = 0, out = 0;
  at::Tensor* a = nullptr;
  at::Tensor* b = nullptr;
};
// Every pair `settings` targets in `blk` (sized to hold the experts), in parameter order: the
// targeted projections in LoraTarget order, in a mixture of experts the attention ones and
// then each expert's gate, up and down. The one enumeration of an adapter's tensors: its
// initialisation, parameters, peft names, files and a block's gradients (whose LoraBlock has
// the same layout) all follow it.
std::vector<LoraSlot> LoraSlots(const ModelConfig& config, const LoraSettings& settings,
                                LoraBlock& blk);

class LoraAdapter {
 public:
  // peft's default init, reproducible from `seed` (drawn on the CPU, then moved to `device`).
  static LoraAdapter Init(const ModelConfig& config, const LoraSettings& settings, uint64_t seed,
                          c10::Device device);
  // Loads a peft adapter folder (adapter_config.json + adapter_model.safetensors; F32, BF16 or
  // F16 weights, converted to f32). Errors name the file and the key.
  static LoraAdapter Load(const std::string& dir, const ModelConfig& config, c10::Device device);
  // A job's start from the adapter its lora.init_from names (Load), refused (kRefused, naming
  // both values) when its settings are not `settings` (the job's, after ApplyInitFrom).
  static LoraAdapter InitFrom(const std::string& dir, const ModelConfig& config,
                              const LoraSettings& settings, c10::Device device);
  // Writes adapter_model.safetensors and adapter_config.json into `dir` (created), each file
  // written to a temporary name and renamed.
  void Save(const std::string& dir, const std::string& base_model_name_or_path) const;

  const LoraSettings& settings() const { return settings_; }
  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  const LoraBlock& block(int i) const { return blocks_.at(i); }
  LoraBlock& block(int i) { return blocks_.at(i); }

  // The defined tensors of block i, in the order (A, B) per target in LoraTarget order.
  std::vector<at::Tensor> BlockParams(int i) const;
  // All trainable tensors (block 0..L-1, each in BlockParams order) and their peft key names.
  std::vector<at::Tensor> Params() const;
  std::vector<std::string> ParamNames() const;

 private:
  ModelConfig config_;
  LoraSettings settings_;
  std::vector<LoraBlock> blocks_;
};

// lora.init_from (common/job/job_spec.h): what the job leaves to the adapter (rank 0, alpha 0, no
// targets) taken from its adapter_config.json, and rank, alpha, targets and rslora the job sets
// refused (kRefused) when they differ, each naming the key, both values and the file. A no-op
// without init_from; idempotent. The worker calls it before it plans or trains.
void ApplyInitFrom(LoraSpec& spec);

}  // namespace lorastream::worker
