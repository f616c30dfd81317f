// Adapter files of the diffusion families in the lora_down / lora_up / alpha form their users
// load (kohya's for FLUX.1, ComfyUI's for Qwen-Image): per module STEM.lora_down.weight
// (A [r, in]), STEM.lora_up.weight (B [out, r]) and STEM.alpha (a scalar), f32; the stem a
// function of the module's full name.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/safetensors.h"
#include "worker/model/dit_ops.h"

namespace lorastream::worker::dit {

using ModuleStem = std::function<std::string(const std::string& module)>;

// f32 CPU copies of tensors to write, kept alive until the file is written.
struct TensorWriter {
  std::vector<at::Tensor> keep;
  std::vector<TensorToWrite> entries;
  void Add(const std::string& name, const at::Tensor& t);
};

void SaveDownUpAdapter(const LoraAdapter& adapter, const ModuleStem& stem, const std::string& path,
                       const std::map<std::string, std::string>& metadata);
// A file's weights into `adapter` (same modules and rank; alpha must match): resume and tests.
// Errors (kCorrupt) name the file and the tensor.
void LoadDownUpAdapter(const std::string& path, const ModuleStem& stem, LoraAdapter& adapter);

}  // namespace lorastream::worker::dit
