// The model's seam to where its block weights come from, owned by the model and implemented
// above it: fully resident on the device (worker/stream/resident_provider.h), or streamed
// through the ring (worker/stream/stream_engine.h; for a job, worker/train/stream_provider.h).
// A family's model (worker/flux/) reads its units through it too. The trainer calls Acquire and
// Release in the step's known order: forward 0..L-1, then (checkpointed backward) L-1..0,
// where each block's forward is recomputed just before its backward.
#pragma once

#include <string>
#include <vector>

#include "common/job/step_stats.h"
#include "worker/model/block_weights.h"

namespace lorastream {
struct JobSpec;
}

namespace lorastream::worker {

class HeadProvider;

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
  // Why the memory this provider's plan was made for cannot also hold `others`, a group's jobs
  // beside the one it was planned for (a job joining a running group, after those already
  // there): the group's estimated peak under this plan beyond the plan's limit (its budget, or
  // the device's memory), naming the last of `others`. "" when it can, or when this provider
  // keeps no estimate (everything resident, no plan).
  virtual std::string JoinRefusal(const std::vector<JobSpec>& others) const {
    (void)others;
    return "";
  }
};

}  // namespace lorastream::worker
