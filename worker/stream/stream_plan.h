// The streaming engine's plan (torch-free): which blocks stay resident on the device, and,
// for one training pass, which block uses need a copy into which ring slot and when each copy
// may be issued.
//
// A pass uses blocks in a known order: forward 0..L-1, then the checkpointed backward
// L-1..0 (each block's forward recomputed right before its backward), so 2L uses. Passes
// repeat (micro-batches, steps), and the plan treats the sequence as cyclic: the backward's
// last blocks are the next forward's first ones, so they stay in their slots across passes.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace lorastream::worker {

// Where each block's base weights live for the whole job, and how many ring slots each phase
// of a pass may hold (the memory timeline). The forward pass runs without the backward's
// recompute activations, the logits/loss buffers and the gradients, so it can hold more slots
// than the moment of the LM head at the same peak; the backward runs after the LM head's
// buffers are gone, so it too can hold more. Slots 0..ring_size-1 live for the whole job
// (they carry the forward's last blocks across the LM head); slots ring_size.. exist only in
// the phase that has them: the engine frees a phase slot after its last use in the phase
// (its memory goes back to the allocator for the next phase's activations) and allocates it
// again when a later phase copies into it.
struct ResidencyPlan {
  std::vector<bool> streamed;  // streamed[i]: block i is copied into the ring when used
  int ring_size = 0;           // slots kept through the whole step (across the LM head);
                               // min(requested ring, streamed blocks); 0 = none stream
  int forward_slots = 0;       // slots during the forward pass (ring_size..streamed blocks)
  int backward_slots = 0;      // slots during the backward pass (ring_size..streamed blocks)
  // Slots during the LM head (ring_size..backward_slots): the backward's slots that exist
  // already while the head runs. Those the forward has too carry its last blocks across the
  // head; the others are allocated when the forward ends and filled with the backward's
  // first blocks while the head computes, so the copy engine does not wait for the head.
  int head_slots = 0;
  // The LM head's weights are copied to the device for the head only (into memory of their
  // own, freed once the chunked head's forward, which also computes its gradient, is done),
  // instead of staying resident for the whole job. The blocks' ring is not involved.
  bool head_streamed = false;
  // A streamed LM head's copy needs this many slots' worth of memory (0: it is copied when
  // the head starts). When the forward frees that many of its slots before it ends, the copy
  // is issued at that point instead (PassPlan::head_copy_after), so it runs during the
  // forward's last blocks; set by FillHeadSlots (worker/stream/stream_budget.h).
  int head_prefetch_slots = 0;
  // The last taped_blocks blocks keep their forward's activations (its tape, worker/model/block.h)
  // into their backward instead of recomputing them there: each costs a tape's memory from
  // its forward through the LM head and saves a block's forward per step (the cost model
  // weighs that against slots and resident blocks). 0: every block is recomputed.
  int taped_blocks = 0;
  // The diffusion families' units (worker/stream/dit_plan.h): the taped ones are the last
  // taped_blocks *resident* units in forward order. Their tape is plain autograd's, which
  // holds the unit's base weights too, and a streamed unit's weights are a ring slot that is
  // overwritten before its backward: a streamed unit is never taped.
  bool tape_resident_only = false;

  int num_blocks() const { return static_cast<int>(streamed.size()); }
  int num_streamed() const;
  int max_slots() const { return std::max(forward_slots, backward_slots); }
  // Slots that stay filled from the forward into the backward (the forward's last blocks).
  int head_boundary_slots() const { return std::min(forward_slots, head_slots); }
  // Slots that stay filled from the end of one pass into the next one's forward; the
  // forward's other slots are allocated and filled at its first acquire (copies issued when
  // the backward ends slowed the step boundary by about their own time, measured).
  int pass_boundary_slots() const { return std::min(forward_slots, backward_slots); }
  // One line for the log: "12 of 16 blocks streamed [0 1 3 ...] through 2 slots; resident
  // [2 ...]" (and "; LM head streamed" when it is).
  std::string Describe() const;
};

// Which blocks keep their activations into their backward: the last plan.taped_blocks
// blocks, or with plan.tape_resident_only the last plan.taped_blocks resident ones (fewer when
// fewer are resident).
std::vector<bool> TapedBlocks(const ResidencyPlan& plan);

// Refusals that hold for every plan (Error kRefused, naming the field and the fix).
void RequireValidRingSize(int ring_size);
// Streaming rewrites ring slots under autograd's feet unless every block is recomputed in
// the backward pass: refuse streaming without gradient checkpointing.
void RequireCheckpointingForStreaming(const ResidencyPlan& plan, bool gradient_checkpointing);

// Streams `blocks_to_swap` blocks (0 = all resident, num_blocks = all streamed). The resident
// blocks are spread evenly over the depth rather than taken from one end: a resident block's
// compute is time in which the copy engine fills the ring for the next streamed block, so
// spreading them keeps the copy engine busy through the whole pass (with the streamed blocks
// at one end, the copy engine idles through a contiguous resident stretch, forward and
// backward, and the streamed stretch is purely transfer-bound). Which blocks stream does not
// change the number of copies: every streamed block is copied twice per pass minus the reuse
// at the turnaround (the forward's last R streamed blocks serve the first backward uses) and
// at the pass boundary (the backward's last R serve the next forward's first uses).
ResidencyPlan PlanFromSwapCount(int num_blocks, int blocks_to_swap, int ring_size);

// `plan` with `forward_slots` and `backward_slots` slots in those phases (0: ring_size), each
// clamped to [ring_size, streamed blocks], and `head_slots` across the LM head (0:
// ring_size), clamped to [ring_size, backward_slots]. Error(kRefused) naming
// stream.forward_slots or stream.backward_slots when one is below ring_size (the slots across
// the LM head are part of both phases).
ResidencyPlan WithPhaseSlots(ResidencyPlan plan, int forward_slots, int backward_slots,
                             int head_slots = 0);

// The step's block order: 0..L-1, L-1..0.
std::vector<int> PassBlockOrder(int num_blocks);

// One use of a block in a pass.
struct BlockUse {
  int block = 0;
  bool backward = false;  // the recompute+backward use
  int slot = -1;          // ring slot it is read from; -1: resident
  bool copy = false;      // a copy into `slot` precedes this use; false for a streamed block
                          // still in its slot (a copy saved)
  // The copy may be issued once use `issue_after` has been Released (its compute event is the
  // one the copy waits for: the slot's previous occupant's last use, invariant 2); -1: at the
  // start of the pass. Always < this use's index; non-decreasing over the pass's copies.
  int issue_after = -1;
  // The copy goes into a slot allocated for it and is issued at the Acquire of use
  // issue_after + 1 instead, the slot allocated first: a backward slot that the LM head does
  // not have (beyond head_slots; the backward has begun: the LM head's buffers are gone), or
  // a forward slot the previous backward did not keep (issue_after = -1: at the forward's
  // first acquire, after the step boundary's host reads). Copies keep their order: once one
  // copy is deferred, the following copies with the same issue_after are deferred too. (A
  // head slot is allocated when the forward ends and is not deferred.)
  bool at_acquire = false;
};

struct PassPlan {
  std::vector<BlockUse> uses;       // 2L, in order
  std::vector<int> slots_at_start;  // block held by each slot when the pass starts (-1 empty)
  std::vector<int> slots_at_end;    // ... and when it ends
  std::vector<std::vector<int>> issue_after_release;  // [u]: uses whose copies follow Release(u)
  std::vector<std::vector<int>> issue_at_acquire;     // [u]: deferred copies issued at Acquire(u)
  std::vector<int> issue_at_start;  // uses whose copies are issued at the start of the pass
  // [u]: phase slots freed right after Release(u) (after the last use in their phase; their
  // blocks are gone).
  std::vector<std::vector<int>> free_after_release;
  // A streamed LM head's copy is issued after Release(head_copy_after), a forward use from
  // which on at most forward_slots - head_prefetch_slots slots are allocated; -1: when the
  // head starts.
  int head_copy_after = -1;

  int copies() const;
  int copies_saved() const;  // streamed uses served by a block already in its slot
  // Multi-line description: one line per use ("fwd 3 slot 1 copy after #2"), for the log.
  std::string Describe() const;
};

// Plans one pass from the slots' contents at its start (all -1 for the first pass; the
// previous pass's slots_at_end afterwards; max_slots() entries, those at and above
// pass_boundary_slots() empty). A streamed block still in a slot is never copied again; a
// copy evicts the slot whose block is needed again furthest in the future (the cyclic order,
// so the next pass counts), which for this order is also the slot released earliest, so
// copies are issued as early as the ring allows. The last blocks of a phase that the next
// phase can keep (head_boundary_slots() of them into the backward, pass_boundary_slots()
// into the next forward) go into slots that survive the phase change; the phase's other
// copies prefer its phase slots, freed after their last use in the phase. So the next pass's
// first blocks are fetched during the backward and from the forward's first acquire, and the
// backward's first blocks during the LM head, into the head slots the forward did not have.
PassPlan PlanPass(const ResidencyPlan& residency, const std::vector<int>& slots_at_start);

// The steady state: the plan of a pass that follows other passes (slots as the previous pass
// left them, starting from an empty ring).
PassPlan PlanSteadyPass(const ResidencyPlan& residency);

}  // namespace lorastream::worker
