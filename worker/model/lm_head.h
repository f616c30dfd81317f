// The LM head: where its weights are when it is computed (HeadProvider: resident on the
// device, or streamed from host RAM like a block, worker/stream/streamed_head.h), and the
// chunked final norm + LM head + cross entropy (worker/model/chunked_head.cc) that training,
// evaluation and calibration use. The full-logits path (CausalLm::Logits + LossSum) stays for
// `lorastream-worker parity`, whose product the logits are, and as the reference the chunked path
// is tested against.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "common/job/step_stats.h"
#include "worker/model/base_weights.h"

namespace lorastream::worker {

class HeadProvider {
 public:
  virtual ~HeadProvider() = default;
  // Makes the LM head's weights available on the compute device. A streamed head is copied
  // here (into memory of its own; a compressed head's compressed bytes) and compute waits for
  // the copy (on CUDA the stream waits on its event, never the host). Acquire and Release
  // alternate.
  virtual void Acquire() = 0;
  // Between Acquire and Release, the head's [vocab, hidden] weights in vocabulary slices of
  // slice_rows() rows (the last may be shorter), in the compute dtype, safe to compute on from
  // the current stream. A plain head is one slice: the whole weight. A compressed head's
  // slice `i` (rows i x slice_rows() on) is expanded when asked into the provider's one
  // scratch: valid until the next Slice or Release.
  virtual at::Tensor Slice(int64_t i) = 0;
  virtual int64_t num_slices() const { return 1; }
  virtual int64_t slice_rows() const = 0;
  virtual int64_t vocab() const = 0;
  // Every kernel that reads the weights has been enqueued: a streamed head's memory (and a
  // compressed head's scratch) goes back to the allocator (compute-stream ordered, as a
  // freed ring slot's).
  virtual void Release() = 0;
  // A streamed head's copy is issued now (its memory allocated, ordered after the compute
  // work enqueued so far) rather than at the next Acquire, which then only waits for it. No
  // effect on a resident head, or when a copy is already in flight.
  virtual void Prefetch() {}
  // Adds the copies since the last call to `stats` (h2d_bytes, copies, H2D busy, stall).
  virtual void CollectStats(StepStats& stats) { (void)stats; }
  virtual bool streamed() const { return false; }
};

// A compressed head's vocabulary slices: each expanded from the head's bytes (wherever the
// provider keeps them: resident, or a streamed head's slot) into one scratch of slice_rows()
// rows, the last slice shorter; freed at Free. Every provider of a compressed head uses it.
class PackedHeadSlices {
 public:
  // `slice_rows` 0: HeadSliceRows's; rounded up to the format's QuantRowAlignment.
  PackedHeadSlices(const PackedWeight& w, c10::ScalarType dtype, int64_t slice_rows);
  int64_t slice_rows() const { return rows_; }
  int64_t num_slices() const { return (w_.rows() + rows_ - 1) / rows_; }
  int64_t vocab() const { return w_.rows(); }
  // Slice `i` expanded from `bytes` (the head's compressed bytes on the compute device):
  // valid until the next Slice or Free.
  at::Tensor Slice(const at::Tensor& bytes, int64_t i);
  void Free();

 private:
  PackedWeight w_;  // layout only
  c10::ScalarType dtype_;
  int64_t rows_ = 0;
  at::Tensor scratch_, staging_;
};

// Between Acquire and Release: the whole [vocab, hidden] weight (a compressed head's slices
// expanded into new memory: the full-logits path, for small models).
at::Tensor WholeHead(HeadProvider& head);

// `weight` [vocab, hidden] converted once to `device` and `dtype` (a no-op view when it is
// already there), kept for the provider's life.
std::unique_ptr<HeadProvider> MakeResidentHead(const at::Tensor& weight, c10::Device device,
                                               c10::ScalarType dtype);

// The head of `rest`: rest.lm_head as above, or a compressed rest.packed_head kept compressed
// (copied to `device` once) and expanded per vocabulary slice of `slice_rows` rows (0:
// HeadSliceRows's, worker/model/head_rows.h; rounded up to the format's QuantRowAlignment).
std::unique_ptr<HeadProvider> MakeResidentHead(const RestWeights& rest, c10::Device device,
                                               c10::ScalarType dtype, int64_t slice_rows = 0);

// The sum over positions of the cross-entropy of RmsNorm(hidden) W^T (W: the head's weights,
// logits in the compute dtype, log-softmax in f32) against `targets` [B, S] (already shifted;
// -100 ignored): an f32 scalar on hidden's device. Computed in chunks of `chunk_rows` rows of
// the flattened [B x S, hidden] states, so that the whole sequence's logits never exist at
// once. With grad enabled and hidden requiring grad, one autograd node: each chunk's gradient
// with respect to its hidden rows, (softmax - onehot) W back through the norm, is computed
// while the chunk's logits exist and kept (B x S x hidden in the compute dtype); the backward
// only scales it by the incoming gradient. The head's weights are acquired for the forward
// only and released at its end: the backward does not read them. A head of several slices
// (compressed) computes each chunk's logits slice by slice and its gradient as the sum over
// the slices (re-expanding each); a head of one slice is the plain path. Without grad, no gradient
// work is done and the result has no grad_fn.
at::Tensor ChunkedHeadLossSum(const at::Tensor& hidden, const at::Tensor& targets,
                              const at::Tensor& norm_weight, double eps, HeadProvider& head,
                              int64_t chunk_rows);

}  // namespace lorastream::worker
