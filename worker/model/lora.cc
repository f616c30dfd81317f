#include "worker/model/lora.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "common/base/error.h"

namespace lorastream::worker {

std::vector<LoraSlot> LoraSlots(const ModelConfig& config, const LoraSettings& settings,
                                LoraBlock& blk) {
  std::vector<LoraSlot> slots;
  for (int t = 0; t < kNumLoraTargets; ++t) {
    if (!settings.targets[t] || (config.is_moe() && t > kOProj)) continue;
    auto [in, out] = LoraTargetShape(config, t);
    slots.push_back({std::string(LoraTargetModule(t)) + "." + LoraTargetName(t), in, out, &blk.a[t],
                     &blk.b[t]});
  }
  if (!config.is_moe()) return slots;
  blk.experts.resize(static_cast<size_t>(config.num_experts));
  for (int64_t e = 0; e < config.num_experts; ++e)
    for (int p = 0; p < 3; ++p) {
      const int t = kGateProj + p;
      if (!settings.targets[t]) continue;
      auto [in, out] = LoraTargetShape(config, t);
      ExpertLora& ex = blk.experts[static_cast<size_t>(e)];
      slots.push_back({config.ExpertModule(e, p), in, out, &ex.a[p], &ex.b[p]});
    }
  return slots;
}

LoraAdapter LoraAdapter::Init(const ModelConfig& config, const LoraSettings& settings,
                              uint64_t seed, c10::Device device) {
  if (settings.rank <= 0)
    throw Error(ErrorCode::kRefused,
                "lora.rank must be > 0 (found " + std::to_string(settings.rank) + ")");
  LoraAdapter a;
  a.config_ = config;
  a.settings_ = settings;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    LoraBlock blk;
    for (const LoraSlot& slot : LoraSlots(config, settings, blk)) {
      // kaiming_uniform_(a=sqrt(5)): gain sqrt(2/(1+5)), bound sqrt(3)*gain/sqrt(fan_in).
      const double gain = std::sqrt(2.0 / 6.0);
      const double bound = std::sqrt(3.0) * (gain / std::sqrt(static_cast<double>(slot.in)));
      at::Tensor A = at::empty({settings.rank, slot.in}, at::kFloat);
      A.uniform_(-bound, bound, gen);
      *slot.a = A.to(device).requires_grad_(true);
      *slot.b =
          at::zeros({slot.out, settings.rank}, at::TensorOptions().dtype(at::kFloat).device(device))
              .requires_grad_(true);
    }
    a.blocks_.push_back(std::move(blk));
  }
  return a;
}

std::vector<at::Tensor> LoraAdapter::BlockParams(int i) const {
  std::vector<at::Tensor> p;
  LoraBlock& blk = const_cast<LoraBlock&>(blocks_.at(i));  // LoraSlots only reads a sized block
  for (const LoraSlot& slot : LoraSlots(config_, settings_, blk)) {
    p.push_back(*slot.a);
    p.push_back(*slot.b);
  }
  return p;
}

std::vector<at::Tensor> LoraAdapter::Params() const {
  std::vector<at::Tensor> p;
  for (int i = 0; i < num_blocks(); ++i)
    for (auto& t : BlockParams(i)) p.push_back(t);
  return p;
}

std::vector<std::string> LoraAdapter::ParamNames() const {
  std::vector<std::string> names;
  for (int i = 0; i < num_blocks(); ++i) {
    LoraBlock& blk = const_cast<LoraBlock&>(blocks_[i]);
    for (const LoraSlot& slot : LoraSlots(config_, settings_, blk)) {
      names.push_back(LoraModuleKey(i, slot.module, false));
      names.push_back(LoraModuleKey(i, slot.module, true));
    }
  }
  return names;
}

}  // namespace lorastream::worker
