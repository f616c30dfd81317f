// The streaming planner: block order, resident/streamed split, slot assignment, reuse and
// copy issue points, checked by simulating every plan against the invariants.
#include <algorithm>
#include <set>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "worker/stream/stream_plan.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

// Walks a pass plan as the engine executes it and checks:
//  - every streamed use reads a slot that holds its block (invariant 1 on the plan level);
//  - a copy is issued after the last use of the slot's previous occupant (invariant 2) and
//    before its own use, and issue points never decrease;
//  - a copy happens only when the block is in no slot (invariant 5);
//  - resident blocks never touch a slot.
void CheckPlan(const ResidencyPlan& r, const PassPlan& p) {
  const int n = 2 * r.num_blocks();
  const int slots_n = r.max_slots();
  REQUIRE(static_cast<int>(p.uses.size()) == n);
  REQUIRE(static_cast<int>(p.slots_at_start.size()) == slots_n);
  std::vector<int> slots = p.slots_at_start;
  std::vector<int> last_use(slots_n, -1);
  int last_issue = -1;
  for (int u = 0; u < n; ++u) {
    const BlockUse& use = p.uses[u];
    REQUIRE(use.block == (u < n / 2 ? u : n - 1 - u));
    REQUIRE(use.backward == (u >= n / 2));
    if (!r.streamed[use.block]) {
      REQUIRE(use.slot == -1);
      REQUIRE_FALSE(use.copy);
      continue;
    }
    REQUIRE(use.slot >= 0);
    REQUIRE(use.slot < (use.backward ? r.backward_slots : r.forward_slots));
    const bool present = std::count(slots.begin(), slots.end(), use.block) > 0;
    REQUIRE(use.copy == !present);
    if (use.copy) {
      REQUIRE(use.issue_after + (use.at_acquire ? 1 : 0) <= u);
      REQUIRE(use.issue_after < u);
      REQUIRE(use.issue_after >= last_use[use.slot]);
      REQUIRE(use.issue_after >= last_issue);
      last_issue = use.issue_after;
      const auto& list = use.at_acquire        ? p.issue_at_acquire[use.issue_after + 1]
                         : use.issue_after < 0 ? p.issue_at_start
                                               : p.issue_after_release[use.issue_after];
      REQUIRE(std::count(list.begin(), list.end(), u) == 1);
      slots[use.slot] = use.block;
    }
    REQUIRE(slots[use.slot] == use.block);
    last_use[use.slot] = u;
    for (int f : p.free_after_release[u]) slots[f] = -1;
  }
  REQUIRE(slots == p.slots_at_end);
  std::set<int> distinct(slots.begin(), slots.end());
  distinct.erase(-1);
  REQUIRE(distinct.size() == static_cast<size_t>(std::count_if(slots.begin(), slots.end(),
                                                               [](int b) { return b >= 0; })));

  // The memory timeline, replayed in the engine's order of events: a slot is allocated from
  // its first copy to its free; never more than the phase's slots at once, at most
  // head_slots across the LM head (between the forward's last release and the backward's
  // first acquire) and at most pass_boundary_slots() filled across the pass boundary (the
  // forward's other slots are allocated when the pass starts).
  std::vector<bool> live(slots_n, false);
  for (int s = 0; s < slots_n; ++s) live[s] = s < r.ring_size || p.slots_at_start[s] >= 0;
  auto count = [&] { return static_cast<int>(std::count(live.begin(), live.end(), true)); };
  REQUIRE(count() <= std::max(r.ring_size, r.pass_boundary_slots()));
  for (int u : p.issue_at_start) live[p.uses[u].slot] = true;
  REQUIRE(count() <= r.forward_slots);
  // A streamed head copied during the forward takes head_prefetch_slots slots' room from the
  // use after head_copy_after to the forward's end.
  if (p.head_copy_after >= 0) {
    REQUIRE(r.head_streamed);
    REQUIRE(p.head_copy_after < n / 2);
  }
  for (int u = 0; u < n; ++u) {
    const int cap = u < n / 2 ? r.forward_slots : r.backward_slots;
    const bool head_copied = p.head_copy_after >= 0 && u > p.head_copy_after && u < n / 2;
    for (int c : p.issue_at_acquire[u]) live[p.uses[c].slot] = true;
    REQUIRE(count() + (head_copied ? r.head_prefetch_slots : 0) <= cap);
    if (p.uses[u].slot >= 0) REQUIRE(live[p.uses[u].slot]);
    for (int f : p.free_after_release[u]) {
      REQUIRE(f >= r.ring_size);  // the ring itself is never freed
      REQUIRE(live[f]);
      live[f] = false;
    }
    for (int c : p.issue_after_release[u]) live[p.uses[c].slot] = true;
    REQUIRE(count() <= (u == n / 2 - 1 ? r.head_slots : cap));  // across the LM head
  }
  REQUIRE(count() <= std::max(r.ring_size, r.pass_boundary_slots()));
}

}  // namespace

TEST_CASE("a pass uses blocks forward then backward", "[worker]") {
  REQUIRE(PassBlockOrder(3) == std::vector<int>{0, 1, 2, 2, 1, 0});
  REQUIRE(PassBlockOrder(1) == std::vector<int>{0, 0});
}

TEST_CASE("blocks_to_swap streams N blocks with the resident ones spread", "[worker]") {
  ResidencyPlan p = PlanFromSwapCount(16, 12, 2);
  REQUIRE(p.num_streamed() == 12);
  REQUIRE(p.ring_size == 2);
  for (int b : {2, 6, 10, 14}) REQUIRE_FALSE(p.streamed[b]);
  REQUIRE(p.Describe().find("12 of 16 blocks streamed") != std::string::npos);

  ResidencyPlan none = PlanFromSwapCount(8, 0, 2);
  REQUIRE(none.num_streamed() == 0);
  REQUIRE(none.ring_size == 0);
  ResidencyPlan all = PlanFromSwapCount(8, 8, 3);
  REQUIRE(all.num_streamed() == 8);
  REQUIRE(all.ring_size == 3);
  // No more slots than streamed blocks.
  REQUIRE(PlanFromSwapCount(8, 1, 3).ring_size == 1);
  for (int l = 1; l <= 20; ++l) {
    for (int n = 0; n <= l; ++n) REQUIRE(PlanFromSwapCount(l, n, 2).num_streamed() == n);
  }
}

TEST_CASE("the planner refuses impossible requests naming the field", "[worker]") {
  try {
    PlanFromSwapCount(8, 2, 0);
    FAIL("ring 0 accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kRefused);
    REQUIRE(std::string(e.what()).find("ring_size") != std::string::npos);
  }
  REQUIRE_THROWS_AS(PlanFromSwapCount(8, 9, 2), Error);
  REQUIRE_THROWS_AS(PlanFromSwapCount(8, -1, 2), Error);
  try {
    RequireCheckpointingForStreaming(PlanFromSwapCount(8, 2, 2), false);
    FAIL("streaming without checkpointing accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kRefused);
    REQUIRE(std::string(e.what()).find("gradient checkpointing") != std::string::npos);
  }
  RequireCheckpointingForStreaming(PlanFromSwapCount(8, 0, 2), false);  // nothing streams
  RequireCheckpointingForStreaming(PlanFromSwapCount(8, 2, 2), true);
}

TEST_CASE("every plan keeps the ring's invariants (all sizes, rings and swap counts)", "[worker]") {
  for (int l = 1; l <= 9; ++l) {
    for (int ring = 1; ring <= 4; ++ring) {
      for (int n = 0; n <= l; ++n) {
        CAPTURE(l, ring, n);
        const ResidencyPlan r = PlanFromSwapCount(l, n, ring);
        PassPlan p = PlanPass(r, std::vector<int>(r.ring_size, -1));
        CheckPlan(r, p);
        for (int pass = 0; pass < 3; ++pass) {  // following passes start from the last state
          p = PlanPass(r, p.slots_at_end);
          CheckPlan(r, p);
        }
        const int rr = r.ring_size;
        // Cold pass: every streamed block copied in the forward, and again in the backward
        // except the forward's last R (the turnaround reuse, invariant 5).
        const PassPlan cold = PlanPass(r, std::vector<int>(rr, -1));
        REQUIRE(cold.copies() == (n > rr ? 2 * n - rr : n));
        REQUIRE(cold.copies_saved() == (n > rr ? rr : n));
        // Steady pass: the backward's last R are also the next forward's first R.
        const PassPlan steady = PlanSteadyPass(r);
        CheckPlan(r, steady);
        REQUIRE(steady.copies() == (n > rr ? 2 * n - 2 * rr : 0));
        REQUIRE(steady.copies_saved() == 2 * n - steady.copies());
      }
    }
  }
}

TEST_CASE("the forward's last blocks serve the first backward uses without a copy", "[worker]") {
  const ResidencyPlan r = PlanFromSwapCount(6, 6, 2);
  const PassPlan p = PlanPass(r, {-1, -1});
  // Uses 6 and 7 are the backward of blocks 5 and 4, still in the ring.
  REQUIRE(p.uses[6].block == 5);
  REQUIRE_FALSE(p.uses[6].copy);
  REQUIRE_FALSE(p.uses[7].copy);
  REQUIRE(p.uses[8].copy);  // block 3 again
  // Double buffering: the copy for forward block k+1... is issued after block k-1's use, so it
  // overlaps block k's compute.
  REQUIRE(p.uses[0].issue_after == -1);
  REQUIRE(p.uses[1].issue_after == -1);
  REQUIRE(p.uses[2].issue_after == 0);
  REQUIRE(p.uses[3].issue_after == 1);
  // The backward's first copy (block 3) goes into the slot of block 5, released at use 6.
  REQUIRE(p.uses[8].slot == p.uses[6].slot);
  REQUIRE(p.uses[8].issue_after == 6);
  // R = 1: no overlap, each copy right after the previous use.
  const PassPlan one = PlanPass(PlanFromSwapCount(3, 3, 1), {-1});
  REQUIRE(one.uses[1].issue_after == 0);
  REQUIRE(one.uses[2].issue_after == 1);
  REQUIRE_FALSE(one.uses[3].copy);  // block 2 at the turnaround
  REQUIRE(one.uses[4].issue_after == 3);
  REQUIRE(one.Describe().find("#3 bwd 2 slot 0 reused") != std::string::npos);
}

TEST_CASE("the benchmark's plan: 12 of 16 streamed through 2 slots", "[worker]") {
  const ResidencyPlan r = PlanFromSwapCount(16, 12, 2);
  const PassPlan steady = PlanSteadyPass(r);
  REQUIRE(steady.copies() == 20);
  REQUIRE(steady.copies_saved() == 4);
  REQUIRE(steady.issue_at_start.empty());  // nothing left to fetch when a pass starts
}

TEST_CASE("phase slots: every plan keeps the invariants and the memory timeline", "[worker]") {
  for (int l = 1; l <= 8; ++l) {
    for (int ring = 1; ring <= 3; ++ring) {
      for (int n = 0; n <= l; ++n) {
        for (int f = ring; f <= ring + 3; ++f) {
          for (int b = ring; b <= ring + 3; ++b) {
            for (int h = ring; h <= b; ++h) {
              CAPTURE(l, ring, n, f, b, h);
              const ResidencyPlan base = PlanFromSwapCount(l, n, ring);
              ResidencyPlan r = WithPhaseSlots(base, f, b, h);
              // Every other plan streams the LM head, copied early when 2 slots are free.
              r.head_streamed = r.head_prefetch_slots = (l + n + f + b + h) % 2 == 0 ? 2 : 0;
              REQUIRE(r.forward_slots == std::min(f, n));
              REQUIRE(r.backward_slots == std::min(b, n));
              REQUIRE(r.head_slots == std::clamp(h, r.ring_size, r.backward_slots));
              PassPlan p = PlanPass(r, std::vector<int>(r.max_slots(), -1));
              CheckPlan(r, p);
              for (int pass = 0; pass < 3; ++pass) {
                p = PlanPass(r, p.slots_at_end);
                CheckPlan(r, p);
              }
              // More slots in a phase never copy more than the ring alone.
              const PassPlan steady = PlanSteadyPass(r);
              CheckPlan(r, steady);
              REQUIRE(steady.copies() <= PlanSteadyPass(base).copies());
              // Long enough to reach the pattern: the turnaround keeps head_boundary_slots()
              // blocks, the pass boundary pass_boundary_slots() blocks, each saving a copy.
              if (n >= r.max_slots() + r.ring_size)
                REQUIRE(steady.copies() ==
                        2 * n - r.head_boundary_slots() - r.pass_boundary_slots());
            }
          }
        }
      }
    }
  }
}

TEST_CASE(
    "phase slots: the next pass's first blocks stay from the backward, the forward's "
    "extra slots fill at its first acquire, the backward's after the LM head",
    "[worker]") {
  // 8 blocks, all streamed; ring 2 across the LM head, 4 slots in the forward, 3 in the
  // backward.
  const ResidencyPlan r = WithPhaseSlots(PlanFromSwapCount(8, 8, 2), 4, 3);
  REQUIRE(r.Describe().find("(4 in the forward, 2 across the LM head, 3 in the backward)") !=
          std::string::npos);
  const PassPlan p = PlanSteadyPass(r);
  // The backward ended with blocks 2, 1, 0 in slots that the forward has too: no copies.
  for (int u = 0; u < 3; ++u) REQUIRE_FALSE(p.uses[u].copy);
  // Forward block 3 goes into the forward's own fourth slot, allocated at the forward's first
  // acquire (after the step boundary's host reads of the loss and the gradient norm, which a
  // copy in flight would delay): nothing is copied when the pass starts.
  REQUIRE(p.uses[3].copy);
  REQUIRE(p.uses[3].slot == 3);
  REQUIRE(p.uses[3].at_acquire);
  REQUIRE(p.uses[3].issue_after == -1);
  REQUIRE(std::count(p.issue_at_acquire[0].begin(), p.issue_at_acquire[0].end(), 3) == 1);
  REQUIRE(p.issue_at_start.empty());
  // The forward's last two blocks (6, 7) go into the ring, which carries them across the LM
  // head to the backward's first uses.
  REQUIRE(p.uses[6].slot < 2);
  REQUIRE(p.uses[7].slot < 2);
  REQUIRE_FALSE(p.uses[8].copy);
  REQUIRE_FALSE(p.uses[9].copy);
  // The forward's phase slots are freed after their last use in the forward.
  int freed = 0;
  for (int u = 0; u < 8; ++u) freed += static_cast<int>(p.free_after_release[u].size());
  REQUIRE(freed == 2);
  // The backward's third slot is allocated once the backward has begun (the LM head's
  // buffers are gone): its first copy is issued at the acquire of use 8.
  REQUIRE(p.uses[10].copy);
  REQUIRE(p.uses[10].at_acquire);
  REQUIRE(p.uses[10].issue_after == 7);
  REQUIRE(std::count(p.issue_at_acquire[8].begin(), p.issue_at_acquire[8].end(), 10) == 1);
  // Steady copies: 8 - 3 in the forward, 8 - 2 in the backward (ring 2 alone: 12).
  REQUIRE(p.copies() == 11);
  REQUIRE(PlanSteadyPass(PlanFromSwapCount(8, 8, 2)).copies() == 12);
  REQUIRE(p.Describe().find("at the acquire of #8") != std::string::npos);
}

TEST_CASE("head slots: the backward's first blocks are copied while the LM head computes",
          "[worker]") {
  // 8 blocks, all streamed; ring 2, 2 slots in the forward, 3 across the LM head and in the
  // backward.
  const ResidencyPlan r = WithPhaseSlots(PlanFromSwapCount(8, 8, 2), 2, 3, 3);
  REQUIRE(r.head_slots == 3);
  REQUIRE(r.head_boundary_slots() == 2);
  const PassPlan p = PlanSteadyPass(r);
  // The forward's last two blocks (6, 7) cross the LM head in the ring; backward block 5 goes
  // into the third slot, allocated when the forward ends and copied during the head.
  REQUIRE_FALSE(p.uses[8].copy);
  REQUIRE_FALSE(p.uses[9].copy);
  REQUIRE(p.uses[10].block == 5);
  REQUIRE(p.uses[10].copy);
  REQUIRE(p.uses[10].slot == 2);
  REQUIRE_FALSE(p.uses[10].at_acquire);
  REQUIRE(p.uses[10].issue_after == 7);
  REQUIRE(std::count(p.issue_after_release[7].begin(), p.issue_after_release[7].end(), 10) == 1);
  // The same copies as without the head slot: it moves a copy earlier, it saves none.
  const PassPlan after_head = PlanSteadyPass(WithPhaseSlots(PlanFromSwapCount(8, 8, 2), 2, 3));
  REQUIRE(after_head.uses[10].at_acquire);
  REQUIRE(p.copies() == after_head.copies());
  // With a third slot in the forward too, the forward's last three blocks cross the head
  // (and the backward's last three the pass boundary): two copies fewer.
  const ResidencyPlan wide = WithPhaseSlots(PlanFromSwapCount(8, 8, 2), 3, 3, 3);
  REQUIRE(wide.head_boundary_slots() == 3);
  const PassPlan q = PlanSteadyPass(wide);
  for (int u = 8; u < 11; ++u) REQUIRE_FALSE(q.uses[u].copy);
  REQUIRE(q.copies() == p.copies() - 2);
}

TEST_CASE("a streamed LM head is copied once the forward has freed room for it", "[worker]") {
  // 8 blocks, all streamed; ring 2, 5 slots in the forward; the head needs 2 slots' room.
  ResidencyPlan r = WithPhaseSlots(PlanFromSwapCount(8, 8, 2), 5, 2);
  r.head_streamed = true;
  r.head_prefetch_slots = 2;
  const PassPlan p = PlanSteadyPass(r);
  CheckPlan(r, p);
  // The forward's three phase slots are freed after their last uses; the copy follows the
  // release after which at most 5 - 2 slots are allocated until the forward ends.
  REQUIRE(p.head_copy_after >= 0);
  REQUIRE(p.head_copy_after < 8);
  REQUIRE(p.Describe().find("then the LM head's copy") != std::string::npos);
  // Without room (or with the head resident) it is copied when the head starts.
  r.head_prefetch_slots = 4;
  REQUIRE(PlanSteadyPass(r).head_copy_after == -1);
  r.head_prefetch_slots = 2;
  r.head_streamed = false;
  REQUIRE(PlanSteadyPass(r).head_copy_after == -1);
}

TEST_CASE("phase slots below the ring are refused naming the key", "[worker]") {
  const ResidencyPlan r = PlanFromSwapCount(8, 6, 3);
  try {
    WithPhaseSlots(r, 2, 0);
    FAIL("forward_slots below ring_size accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kRefused);
    REQUIRE(std::string(e.what()).find("stream.forward_slots") != std::string::npos);
  }
  REQUIRE_THROWS_AS(WithPhaseSlots(r, 0, 1), Error);
  const ResidencyPlan same = WithPhaseSlots(r, 0, 0);
  REQUIRE(same.forward_slots == 3);
  REQUIRE(same.backward_slots == 3);
  REQUIRE(WithPhaseSlots(r, 100, 5).forward_slots == 6);  // no more than the streamed blocks
}
