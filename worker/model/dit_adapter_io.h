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

#include "common/formats/safetensors.h"
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

// The blocks of one kind of a diffusion model, for reading what a file adapts: their count, the
// linears a trainer may adapt (block-relative, in the order targets are listed) and the stem of
// block i's module m.
struct BlockKind {
  std::string what;  // "double" / "single" / "" (named in errors: "the 19 double blocks")
  int64_t blocks = 0;
  std::vector<std::string> linears;
  std::function<std::string(int64_t block, const std::string& linear)> stem;
};

// What a down/up file holds, read from its keys and shapes: the block-relative modules it
// adapts (in each kind's linears order, kinds in order; every block of a kind must carry the
// same ones), its rank (lora_down's rows) and alpha. Refuses (kCorrupt / kUnsupported, naming
// the file and the key) a key of no module of `kinds`, a module without its three tensors,
// ranks or alphas that differ between modules. `family` names the model in errors.
struct DownUpAdapterInfo {
  std::vector<std::string> targets;
  int64_t rank = 0;
  double alpha = 0.0;
};
DownUpAdapterInfo ReadDownUpAdapterInfo(const std::string& path,
                                        const std::vector<BlockKind>& kinds,
                                        const std::string& family);

// init_from's rule for a diffusion job (`prefix`: where its keys live, "flux." or "lora."):
// what the job leaves to the file (rank 0, alpha 0, no targets) taken from `info`, and rank,
// alpha and targets (resolved by `resolve`) it sets refused (kRefused) when they differ, each
// naming the key, both values and `file`.
void ApplyDownUpInitFrom(
    const DownUpAdapterInfo& info, const std::string& file, const std::string& prefix,
    const std::function<std::vector<std::string>(const std::vector<std::string>&)>& resolve,
    int64_t& rank, double& alpha, std::vector<std::string>& targets);

}  // namespace lorastream::worker::dit
