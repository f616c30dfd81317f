#include "worker/model/lora.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "common/error.h"

namespace lorastream::worker {

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
    for (int t = 0; t < kNumLoraTargets; ++t) {
      if (!settings.targets[t]) continue;
      auto [in, out] = LoraTargetShape(config, t);
      // kaiming_uniform_(a=sqrt(5)): gain sqrt(2/(1+5)), bound sqrt(3)*gain/sqrt(fan_in).
      const double gain = std::sqrt(2.0 / 6.0);
      const double bound = std::sqrt(3.0) * (gain / std::sqrt(static_cast<double>(in)));
      at::Tensor A = at::empty({settings.rank, in}, at::kFloat);
      A.uniform_(-bound, bound, gen);
      blk.a[t] = A.to(device).requires_grad_(true);
      blk.b[t] =
          at::zeros({out, settings.rank}, at::TensorOptions().dtype(at::kFloat).device(device))
              .requires_grad_(true);
    }
    a.blocks_.push_back(std::move(blk));
  }
  return a;
}

std::vector<at::Tensor> LoraAdapter::BlockParams(int i) const {
  std::vector<at::Tensor> p;
  const LoraBlock& blk = blocks_.at(i);
  for (int t = 0; t < kNumLoraTargets; ++t) {
    if (!blk.a[t].defined()) continue;
    p.push_back(blk.a[t]);
    p.push_back(blk.b[t]);
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
  for (int i = 0; i < num_blocks(); ++i)
    for (int t = 0; t < kNumLoraTargets; ++t) {
      if (!blocks_[i].a[t].defined()) continue;
      names.push_back(LoraKey(i, t, false));
      names.push_back(LoraKey(i, t, true));
    }
  return names;
}

}  // namespace lorastream::worker
