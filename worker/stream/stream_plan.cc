#include "worker/stream/stream_plan.h"

#include <algorithm>
#include <sstream>
#include <tuple>

#include "common/base/error.h"

namespace lorastream::worker {

int ResidencyPlan::num_streamed() const {
  return static_cast<int>(std::count(streamed.begin(), streamed.end(), true));
}

std::string ResidencyPlan::Describe() const {
  std::ostringstream s, resident;
  s << num_streamed() << " of " << num_blocks() << " blocks streamed [";
  bool first_s = true, first_r = true;
  for (int i = 0; i < num_blocks(); ++i) {
    if (streamed[i]) {
      s << (first_s ? "" : " ") << i;
      first_s = false;
    } else {
      resident << (first_r ? "" : " ") << i;
      first_r = false;
    }
  }
  s << "] through " << ring_size << " ring slot" << (ring_size == 1 ? "" : "s");
  if (forward_slots != ring_size || backward_slots != ring_size || head_slots != ring_size)
    s << " (" << forward_slots << " in the forward, " << head_slots << " across the LM head, "
      << backward_slots << " in the backward)";
  s << "; resident [" << resident.str() << "]";
  if (head_streamed) s << "; LM head streamed";
  if (taped_blocks > 0 && tape_resident_only) {
    const std::vector<bool> taped = TapedBlocks(*this);
    s << "; taped (keep their activations) [";
    bool first = true;
    for (int i = 0; i < num_blocks(); ++i)
      if (taped[i]) {
        s << (first ? "" : " ") << i;
        first = false;
      }
    s << "]";
  } else if (taped_blocks > 0) {
    s << "; the last " << taped_blocks << " block"
      << (taped_blocks == 1 ? " keeps its" : "s keep their") << " activations";
  }
  return s.str();
}

std::vector<bool> TapedBlocks(const ResidencyPlan& plan) {
  std::vector<bool> taped(plan.streamed.size(), false);
  int left = plan.taped_blocks;
  for (int i = plan.num_blocks() - 1; i >= 0 && left > 0; --i) {
    if (plan.tape_resident_only && plan.streamed[i]) continue;
    taped[i] = true;
    --left;
  }
  return taped;
}

void RequireValidRingSize(int ring_size) {
  if (ring_size < 1) {
    throw Error(ErrorCode::kRefused,
                "stream.ring_size must be >= 1 (found " + std::to_string(ring_size) +
                    "): set ring_size = 2 for double buffering, or 1 for the least memory");
  }
}

void RequireCheckpointingForStreaming(const ResidencyPlan& plan, bool gradient_checkpointing) {
  if (plan.num_streamed() > 0 && !gradient_checkpointing) {
    throw Error(ErrorCode::kRefused,
                "streaming " + std::to_string(plan.num_streamed()) +
                    " blocks needs gradient checkpointing (a ring slot is overwritten while "
                    "autograd still holds views of it): turn gradient checkpointing on, or "
                    "set stream.blocks_to_swap = 0 and stream.gpu_memory_budget = 0 to keep "
                    "every block resident");
  }
}

ResidencyPlan PlanFromSwapCount(int num_blocks, int blocks_to_swap, int ring_size) {
  RequireValidRingSize(ring_size);
  if (num_blocks < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "the model has no transformer blocks (num_hidden_layers = " +
                    std::to_string(num_blocks) + ")");
  }
  if (blocks_to_swap < 0 || blocks_to_swap > num_blocks) {
    throw Error(ErrorCode::kRefused, "stream.blocks_to_swap must be in [0, " +
                                         std::to_string(num_blocks) + "] for this " +
                                         std::to_string(num_blocks) + "-block model (found " +
                                         std::to_string(blocks_to_swap) + ")");
  }
  ResidencyPlan plan;
  plan.streamed.assign(num_blocks, true);
  const int resident = num_blocks - blocks_to_swap;
  // Resident block j sits at the centre of the j-th of `resident` equal stretches.
  for (int j = 0; j < resident; ++j) {
    const int block = static_cast<int>((2LL * j + 1) * num_blocks / (2LL * resident));
    plan.streamed[block] = false;
  }
  LS_CHECK(plan.num_streamed() == blocks_to_swap, "resident blocks collided");
  plan.ring_size = std::min(ring_size, blocks_to_swap);
  plan.forward_slots = plan.backward_slots = plan.head_slots = plan.ring_size;
  return plan;
}

ResidencyPlan WithPhaseSlots(ResidencyPlan plan, int forward_slots, int backward_slots,
                             int head_slots) {
  auto check = [&](int slots, const char* key) {
    if (slots != 0 && slots < plan.ring_size) {
      throw Error(ErrorCode::kRefused,
                  std::string("stream.") + key + " must be 0 (= ring_size) or >= ring_size = " +
                      std::to_string(plan.ring_size) + " (found " + std::to_string(slots) +
                      "): the slots that carry blocks across the LM head belong to both "
                      "phases; lower ring_size instead");
    }
    return std::min(slots == 0 ? plan.ring_size : slots, plan.num_streamed());
  };
  plan.forward_slots = check(forward_slots, "forward_slots");
  plan.backward_slots = check(backward_slots, "backward_slots");
  plan.head_slots = std::clamp(head_slots, plan.ring_size, plan.backward_slots);
  return plan;
}

std::vector<int> PassBlockOrder(int num_blocks) {
  std::vector<int> order;
  order.reserve(2 * num_blocks);
  for (int i = 0; i < num_blocks; ++i) order.push_back(i);
  for (int i = num_blocks - 1; i >= 0; --i) order.push_back(i);
  return order;
}

int PassPlan::copies() const {
  return static_cast<int>(
      std::count_if(uses.begin(), uses.end(), [](const BlockUse& u) { return u.copy; }));
}

int PassPlan::copies_saved() const {
  return static_cast<int>(std::count_if(uses.begin(), uses.end(),
                                        [](const BlockUse& u) { return u.slot >= 0 && !u.copy; }));
}

std::string PassPlan::Describe() const {
  std::ostringstream s;
  for (size_t u = 0; u < uses.size(); ++u) {
    const BlockUse& use = uses[u];
    s << "#" << u << (use.backward ? " bwd " : " fwd ") << use.block;
    if (use.slot < 0) {
      s << " resident";
    } else if (use.copy) {
      s << " slot " << use.slot << " copy issued "
        << (use.issue_after < 0 ? std::string("at pass start")
                                : "after #" + std::to_string(use.issue_after));
    } else {
      s << " slot " << use.slot << " reused";
    }
    if (use.at_acquire) s << " (at the acquire of #" << use.issue_after + 1 << ")";
    for (int f : free_after_release[u]) s << "; frees slot " << f;
    if (static_cast<int>(u) == head_copy_after) s << "; then the LM head's copy";
    s << "\n";
  }
  return s.str();
}

namespace {

// The earliest forward use after whose release at most forward_slots - head_prefetch_slots
// slots are allocated until the forward ends (the head slots allocated at its last release
// excepted: the LM head's phase counts them with the head's weights); -1 when there is none.
int HeadCopyPoint(const ResidencyPlan& residency, const PassPlan& plan) {
  const int num_blocks = residency.num_blocks();
  if (!residency.head_streamed || residency.head_prefetch_slots <= 0 || num_blocks == 0) return -1;
  const int limit = residency.forward_slots - residency.head_prefetch_slots;
  std::vector<bool> live(residency.max_slots(), false);
  for (int s = 0; s < residency.max_slots(); ++s)
    live[s] = s < residency.ring_size || plan.slots_at_start[s] >= 0;
  for (int u : plan.issue_at_start) live[plan.uses[u].slot] = true;
  std::vector<int> live_after(num_blocks);
  for (int u = 0; u < num_blocks; ++u) {
    for (int c : plan.issue_at_acquire[u]) live[plan.uses[c].slot] = true;
    for (int f : plan.free_after_release[u]) live[f] = false;
    if (u < num_blocks - 1)
      for (int c : plan.issue_after_release[u]) live[plan.uses[c].slot] = true;
    live_after[u] = static_cast<int>(std::count(live.begin(), live.end(), true));
  }
  int point = -1;
  for (int u = num_blocks - 1; u >= 0 && live_after[u] <= limit; --u) point = u;
  return point;
}

}  // namespace

PassPlan PlanPass(const ResidencyPlan& residency, const std::vector<int>& slots_at_start) {
  const int num_blocks = residency.num_blocks();
  const int ring = residency.ring_size;
  const int slots = residency.max_slots();
  LS_CHECK(static_cast<int>(slots_at_start.size()) == slots, "slot state of the wrong size");
  LS_CHECK(ring > 0 || residency.num_streamed() == 0, "streamed blocks without a ring");
  LS_CHECK(residency.forward_slots >= ring && residency.backward_slots >= ring &&
               residency.head_slots >= ring && residency.head_slots <= residency.backward_slots,
           "a phase with fewer slots than the ring, or more across the LM head than after it");
  const std::vector<int> order = PassBlockOrder(num_blocks);
  const int n = static_cast<int>(order.size());

  PassPlan plan;
  plan.slots_at_start = slots_at_start;
  plan.issue_after_release.assign(n, {});
  plan.issue_at_acquire.assign(n, {});
  plan.free_after_release.assign(n, {});
  std::vector<int> slot_block = slots_at_start;
  std::vector<int> slot_last_use(slots, -1);  // last use in this pass of the slot's block
  // A slot is allocated while it holds a block (or one is being copied into it); the ring's
  // own slots always are.
  std::vector<bool> live(slots, false);
  for (int s = 0; s < slots; ++s) {
    LS_CHECK(slot_block[s] < 0 || s < residency.pass_boundary_slots(),
             "a phase slot filled at the start of a pass");
    live[s] = s < ring || slot_block[s] >= 0;
  }

  // Position (in the cyclic sequence) of the next use of `block` strictly after use u.
  auto next_use = [&](int block, int u) {
    for (int k = u + 1; k < u + 1 + n; ++k) {
      if (order[k % n] == block) return k;
    }
    return u + 1 + n;  // never (cannot happen for a streamed block)
  };

  int last_issue = -1;
  bool last_at_acquire = false;
  // The backward's slots that exist during the LM head without holding one of the forward's
  // blocks: allocated when the forward ends, filled while the head computes.
  const int head_keep = residency.head_boundary_slots();
  auto head_prefetch = [&](int s) { return s >= head_keep && s < residency.head_slots; };
  for (int phase = 0; phase < 2; ++phase) {
    const int begin = phase * num_blocks, end = begin + num_blocks;
    const int cap = phase == 0 ? residency.forward_slots : residency.backward_slots;
    // Slots that stay filled into the next phase: those the LM head has too, then the slots
    // both the backward and the next forward have.
    const int keep = phase == 0 ? head_keep : residency.pass_boundary_slots();
    // The phase's last `keep` streamed uses go into those slots.
    std::vector<bool> survivor(n, false);
    for (int u = end - 1, k = 0; u >= begin && k < keep; --u) {
      if (!residency.streamed[order[u]]) continue;
      survivor[u] = true;
      ++k;
    }
    for (int u = begin; u < end; ++u) {
      BlockUse use;
      use.block = order[u];
      use.backward = phase == 1;
      if (residency.streamed[use.block]) {
        auto held = std::find(slot_block.begin(), slot_block.end(), use.block);
        if (held != slot_block.end()) {
          use.slot = static_cast<int>(held - slot_block.begin());
        } else {
          // An empty slot first, then one whose block is not used again in the phase (of
          // those, the one released earliest: its copy can be issued soonest), then the block
          // needed again furthest in the future. A block the next phase uses is no reason to
          // spare its slot: the blocks that stay into the next phase are the survivors, copied
          // later into the slots that survive. (Sparing the surviving slots' blocks until then
          // funnelled every other copy of the phase through its one extra slot, one at a time.)
          // Survivors take the low slots, the others the high ones.
          const int limit = survivor[u] ? keep : cap;
          int victim = -1;
          std::tuple<int, int, int, int> victim_key(-1, 0, 0, 0);
          for (int s = 0; s < limit; ++s) {
            std::tuple<int, int, int, int> key;
            // Survivors: the lowest slot; the others: the highest phase slot, else the lowest.
            const int order_pref = survivor[u] || s < keep ? slots - 1 - s : slots + s;
            if (slot_block[s] < 0) {
              // Of the empty slots, the backward fills the LM head's first: their copies run
              // during the head.
              const int during_head = phase == 1 && !live[s] && head_prefetch(s) ? 1 : 0;
              key = {4 * n, during_head, -slot_last_use[s], order_pref};
            } else {
              const int next = next_use(slot_block[s], u);
              key = next >= end
                        ? std::tuple<int, int, int, int>{3 * n, 0, -slot_last_use[s], order_pref}
                        : std::tuple<int, int, int, int>{next, 0, 0, order_pref};
            }
            if (key > victim_key) {
              victim = s;
              victim_key = key;
            }
          }
          use.slot = victim;
          use.copy = true;
          use.issue_after = std::max(slot_last_use[victim], last_issue);
          if (!live[victim] && use.issue_after < begin) {
            // A slot allocated for this copy belongs to the phase: it is allocated and filled
            // at the phase's first acquire (the forward's: the previous backward did not keep
            // it; the backward's: the LM head's buffers are gone), except a head slot, which
            // the forward's end allocates and the LM head's time fills. (A forward slot filled
            // when the pass started cost an H200 about its copy's 8 ms per step, with no stall
            // counted; between the two points the host reads the loss and the gradient norm.)
            use.issue_after = begin - 1;
            use.at_acquire = phase == 0 || !head_prefetch(victim);
          }
          if (use.issue_after == last_issue && last_at_acquire) {
            use.at_acquire = true;  // after a deferred copy of the same point: keep the order
          }
          last_issue = use.issue_after;
          last_at_acquire = use.at_acquire;
          slot_block[victim] = use.block;
          live[victim] = true;
          if (use.at_acquire) {
            plan.issue_at_acquire[use.issue_after + 1].push_back(u);
          } else if (use.issue_after < 0) {
            plan.issue_at_start.push_back(u);
          } else {
            plan.issue_after_release[use.issue_after].push_back(u);
          }
        }
        slot_last_use[use.slot] = u;
      }
      plan.uses.push_back(use);
    }
    // Slots the next phase does not have are freed after their last use in this one.
    for (int s = keep; s < slots; ++s) {
      if (!live[s] || s < ring) continue;
      LS_CHECK(slot_last_use[s] >= begin, "a phase slot filled but unused in its phase");
      plan.free_after_release[slot_last_use[s]].push_back(s);
      slot_block[s] = -1;
      live[s] = false;
    }
  }
  plan.slots_at_end = slot_block;
  plan.head_copy_after = HeadCopyPoint(residency, plan);
  return plan;
}

PassPlan PlanSteadyPass(const ResidencyPlan& residency) {
  PassPlan plan = PlanPass(residency, std::vector<int>(residency.max_slots(), -1));
  // The slot contents at the end of a pass are the last R streamed blocks of the backward,
  // so the state converges after one or two passes; a few more iterations are a safety net.
  for (int i = 0; i < 4; ++i) {
    PassPlan next = PlanPass(residency, plan.slots_at_end);
    const bool fixed = next.slots_at_end == plan.slots_at_end;
    plan = std::move(next);
    if (fixed) break;
  }
  return plan;
}

}  // namespace lorastream::worker
