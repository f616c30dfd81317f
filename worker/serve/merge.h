// `lorastream-worker merge`: a base model with one or more LoRA adapters folded in, written in
// the family's checkpoint format, so that a user without lorastream or peft can serve it.
//
//   LLM:  base = a Hugging Face checkpoint folder (a mixture of experts' too: each expert's
//         projections adapted as peft names them); adapters = peft folders (our output_dir or
//         a checkpoint-N/); out = a Hugging Face folder: config.json (its dtype set to the
//         output's), every other file of the base's folder that is not a weight (tokenizer,
//         generation config, chat template) copied, model-0000i-of-0000N.safetensors shards
//         and model.safetensors.index.json.
//   FLUX: base = BFL's single file, a diffusers folder (transformer/ with config.json and
//         diffusion_pytorch_model shards) or a store serving either; adapters = kohya files
//         (adapter_kohya.safetensors, or the folder holding one); out = `format`: one BFL file
//         (a BFL base's metadata kept) or a diffusers folder (OUT/transformer/: config.json,
//         diffusion_pytorch_model.safetensors or shards and their index, FluxTransformer2DModel's
//         names: common/formats/flux_diffusers.h), by default the base's own form (a store's: BFL).
//   A store (`base` names one that lorastream-store serves, of either family): its weights as
//         the worker computes with them, a compressed store's linears dequantised into its
//         dtype (said on stderr and in the summary line).
//
// Each target weight becomes W + sum_k weight_k * scale_k * B_k A_k, computed in f32 and then
// cast to the output dtype; every other floating tensor is cast, others are copied. One tensor
// is held at a time (the writer streams), so bases larger than memory merge. The output is
// written under a temporary name beside it and renamed into place; an existing output is
// refused unless `force`. Torch-free header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream::worker {

struct MergeOptions {
  std::string base;                       // checkpoint folder or file, or a store's name
  std::vector<std::string> adapters;      // "PATH" or "PATH:WEIGHT" (weight 1 by default)
  std::string out;                        // folder (LLM, FLUX diffusers) or file (FLUX BFL)
  std::string format;                     // FLUX: "bfl" | "diffusers" ("": the base's form)
  std::string dtype = "bf16";             // bf16 | f32
  bool force = false;                     // replace an existing output
  uint64_t max_shard_bytes = 5ull << 30;  // a folder's shards (Hugging Face's default: 5 GB)
  bool progress = true;                   // progress lines on stderr
};

// An adapter argument "PATH[:WEIGHT]": the weight is what follows the last ':' when it parses
// as a number (a path may itself hold ':'). Error(kInvalidArgument) for a non-finite weight.
struct AdapterArg {
  std::string path;
  double weight = 1.0;
};
AdapterArg ParseAdapterArg(const std::string& arg);

// Merges and prints one summary line; errors name the file, the tensor or the option.
void RunMerge(const MergeOptions& options);

}  // namespace lorastream::worker
