// What `lorastream-worker parity` reads, made for the worker's tests: a token batch and an
// adapter whose A and B are both random (so that every LoRA gradient is non-zero).
#pragma once

#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/formats/model_config.h"
#include "common/formats/safetensors.h"
#include "worker/model/lora.h"

namespace lorastream::testing {

struct ParityInputs {
  at::Tensor ids, labels;  // [2, 16]; the first 3 labels -100
  worker::LoraAdapter adapter;
};

// Writes DIR/tokens.safetensors and DIR/adapter/ (rank 4, alpha 8, all seven projections,
// weights uniform in [-0.1, 0.1], saved naming `model` as its base).
inline ParityInputs WriteParityInputs(const std::string& dir, const ModelConfig& c,
                                      const std::string& model) {
  at::Tensor ids = at::randint(0, c.vocab_size, {2, 16}, at::kLong);
  at::Tensor labels = ids.clone();
  labels.narrow(1, 0, 3).fill_(-100);
  WriteSafetensors(dir + "/tokens.safetensors",
                   {{"input_ids", DType::kI64, {2, 16}, ids.data_ptr()},
                    {"labels", DType::kI64, {2, 16}, labels.data_ptr()}});
  worker::LoraSettings s;
  s.rank = 4;
  s.alpha = 8;
  s.targets.fill(true);
  worker::LoraAdapter adapter = worker::LoraAdapter::Init(c, s, 3, at::kCPU);
  {
    c10::NoGradGuard g;
    for (auto& p : adapter.Params()) p.uniform_(-0.1, 0.1);
  }
  adapter.Save(dir + "/adapter", model);
  return {ids, labels, std::move(adapter)};
}

}  // namespace lorastream::testing
