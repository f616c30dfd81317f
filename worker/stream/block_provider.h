// The seam between the model and where its block weights come from: fully resident on the
// device, or streamed through the ring (the streaming engine). The trainer calls Acquire and
// Release in the step's known order: forward 0..L-1, then (checkpointed backward) L-1..0,
// where each block's forward is recomputed just before its backward.
#pragma once

#include <map>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/manifest.h"
#include "common/step_stats.h"

namespace lorastream::worker {

class HeadProvider;

// Views of one block's base weights (never requiring grad). Optional tensors are undefined
// when the architecture has none (biases: qwen2; q_norm/k_norm: qwen3). A block of a family
// whose blocks are not an LLM's (a FLUX.1 streaming unit: one double-stream block or a few
// single-stream ones) has every tensor in `named`, under its name in the segment, and no
// field above; an LLM block has `named` empty.
struct BlockWeights {
  at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj;
  at::Tensor q_bias, k_bias, v_bias, q_norm, k_norm;
  at::Tensor post_norm, gate_proj, up_proj, down_proj;
  std::map<std::string, at::Tensor> named;
};

// Where a segment's tensors go in BlockWeights: an LLM block's into the fields (a tensor
// without one is refused as corrupt), any other family's into `named`.
enum class BlockNaming { kLlmFields, kByName };
// kByName for a FLUX manifest, kLlmFields for every LLM family.
BlockNaming BlockNamingOf(const Manifest& manifest);

// Views at the manifest's offsets over `bytes` (a uint8 tensor holding one block's packed
// bytes, on any device); no copy.
BlockWeights BlockWeightsFromBytes(const at::Tensor& bytes, const SegmentInfo& layout,
                                   BlockNaming naming = BlockNaming::kLlmFields);

// The field holding the tensor of block-relative name `name` ("self_attn.q_proj.weight"), or
// nullptr when BlockWeights has none of that name.
at::Tensor* BlockWeightField(BlockWeights& weights, const std::string& name);
const at::Tensor* BlockWeightField(const BlockWeights& weights, const std::string& name);
// Where the tensor `name` of a segment goes under `naming`: its LLM field (nullptr when there
// is none of that name), or its entry of `named` (created when absent).
at::Tensor* BlockWeightSlot(BlockWeights& weights, const std::string& name, BlockNaming naming);

class BlockProvider {
 public:
  virtual ~BlockProvider() = default;
  virtual int num_blocks() const = 0;
  // Starts a training step (the streaming engine begins prefetching the step's first blocks).
  virtual void BeginStep() = 0;
  // The weights of `block`, safe to compute on from the current stream: on CUDA the current
  // stream waits on the block's copy event (never the host). Called in the step's order.
  virtual const BlockWeights& Acquire(int block) = 0;
  // Every kernel that reads `block` for this use has been enqueued; its slot may be reused
  // once the compute work enqueued so far has completed.
  virtual void Release(int block) = 0;
  // Ends the step; fills the streaming fields of `stats` (h2d_bytes, stall, copies...).
  virtual void EndStep(StepStats& stats) = 0;
  // The LM head's weights when this provider's plan streams them (worker/model/lm_head.h); nullptr:
  // the caller keeps the head resident itself.
  virtual HeadProvider* lm_head() { return nullptr; }
  // Training keeps the forward's activations of the last taped_blocks() blocks into their
  // backward instead of recomputing them (ResidencyPlan::taped_blocks: the plan's memory
  // counts them); 0: every block is recomputed.
  virtual int taped_blocks() const { return 0; }
  // Acquire and Release enqueue no device work and wait for nothing: every block and the LM
  // head are resident, so a training micro-batch's device work is the same at every step and
  // may be captured once as a CUDA graph and replayed (worker/train/micro_batch_runner.h).
  virtual bool step_is_host_only() const { return false; }
};

}  // namespace lorastream::worker
