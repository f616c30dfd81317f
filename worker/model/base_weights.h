// The frozen base model's weights as at::Tensor views, from either source:
//  - a Hugging Face checkpoint folder (common/formats/safetensors.h, mmapped read-only), or
//  - a store published by `lorastream-store serve` (store/attach.h, shared memory).
// On the host the views are zero-copy (at::from_blob over the mapping; each view keeps the
// mapping alive). Base weights never require grad and are never written: the mappings are
// read-only, so an in-place write would fault rather than corrupt another process.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/base/dtype.h"
#include "common/formats/manifest.h"
#include "common/formats/model_config.h"
#include "worker/model/block_weights.h"
#include "worker/model/packed_weight.h"

namespace lorastream {
struct JobSpec;
}  // namespace lorastream

namespace lorastream::worker {

// The non-block tensors. lm_head is the embedding when the model ties them. A store may keep
// the LM head and the embedding table compressed (packed_head, packed_embed: the tensor of
// the same role is then undefined; a tied model's compressed table is both).
struct RestWeights {
  at::Tensor embed_tokens, norm, lm_head;
  PackedWeight packed_embed, packed_head;
};

class BaseWeights {
 public:
  static BaseWeights FromCheckpoint(const std::string& dir);
  // Attaches the published store `name` read-only.
  static BaseWeights FromStore(const std::string& name);
  // The source named by a job's [model] section.
  static BaseWeights ForJob(const JobSpec& spec);

  const ModelConfig& config() const { return config_; }
  // What adapter_config.json's base_model_name_or_path says: the checkpoint folder, or the
  // folder the store was loaded from (or its name).
  const std::string& name_or_path() const { return name_or_path_; }
  int num_blocks() const { return static_cast<int>(config_.num_hidden_layers); }
  // A compressed store's block is expanded (on the host, in the store's dtype) on its first
  // request and kept: streaming never asks for it, so the host holds no expanded copy of what
  // it streams.
  const BlockWeights& block(int i) const;
  const RestWeights& rest() const { return rest_; }

  // Store source only (nullptr / empty otherwise): the manifest and each block's packed bytes
  // (the streaming engine copies those, one contiguous region per block).
  const Manifest* manifest() const { return manifest_ ? manifest_.get() : nullptr; }
  const std::vector<const uint8_t*>& block_bytes() const { return block_bytes_; }

 private:
  ModelConfig config_;
  std::string name_or_path_;
  std::vector<BlockWeights> blocks_;
  RestWeights rest_;
  std::shared_ptr<const Manifest> manifest_;
  std::vector<const uint8_t*> block_bytes_;
  std::shared_ptr<void> owner_;  // the checkpoint mapping / store attachment
  struct Expansions;             // a compressed store's blocks, expanded on first use (thread-safe)
  std::shared_ptr<Expansions> expansions_;
};

// at::ScalarType of a stored dtype (f32, bf16, f16, f64); Error(kUnsupported) otherwise.
c10::ScalarType ScalarTypeOf(DType dtype, const std::string& what);
// The stored dtype of a compute dtype (the same four); Error(kUnsupported) otherwise.
DType DTypeOf(c10::ScalarType type);

// The rest for a model computing on `device` in `dtype` with its LM head resident: embed_tokens,
// norm and lm_head converted (a tied lm_head the converted table); compressed tables kept as
// they are (the model expands them: the head per slice, the embedding's rows on the host).
RestWeights RestOnDevice(const RestWeights& rest, const ModelConfig& config, c10::Device device,
                         c10::ScalarType dtype);

// Every tensor of `w` converted with `to(device, dtype)`: a no-op (same views) when they
// already match, a single copy otherwise.
BlockWeights ConvertBlock(const BlockWeights& w, c10::Device device, c10::ScalarType dtype);

}  // namespace lorastream::worker
