#include "worker/stream/dit_plan.h"

#include <cstdio>
#include <sstream>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "worker/stream/stream_budget.h"

namespace lorastream::worker {

namespace {

int Kinds(const DitMemoryModel& m) { return std::max<int>(1, m.kind_names.size()); }

// How many units of each kind.
std::vector<int> KindCounts(const DitMemoryModel& m) {
  std::vector<int> n(Kinds(m), 0);
  for (int k : m.unit_kind) ++n[k];
  return n;
}

// One job's terms alone (no group).
DitMemoryEstimate EstimateAlone(const DitMemoryModel& m, const DitJob& job,
                                const ResidencyPlan& plan) {
  const uint64_t t = static_cast<uint64_t>(job.image_tokens + job.text_tokens);
  const uint64_t batch = static_cast<uint64_t>(job.batch);
  const uint64_t bt = batch * t;
  DitMemoryEstimate e;
  e.rest = m.rest_bytes;
  e.reserve = m.reserve_bytes;
  // A DiT's A and B factors are thousands of elements each (rank x 3072 for FLUX.1): every one
  // at 8 bits where the moments are, its padding to whole blocks left out.
  e.adapter = AdapterStateBytes(static_cast<uint64_t>(job.lora_params), job.eight_bit_optimizer);
  e.checkpoints = bt * m.checkpoint_per_token + (m.table_per_latent ? bt : t) * m.table_per_token;
  uint64_t largest_backward = 0;
  for (size_t u = 0; u < m.unit_bytes.size(); ++u) {
    // A compressed unit holds its compressed bytes, resident or in a slot; its uses share one
    // expansion scratch.
    if (!m.expanded_bytes.empty()) e.expansion = std::max(e.expansion, m.expanded_bytes[u]);
    if (plan.streamed[u])
      e.slot = std::max(e.slot, m.unit_bytes[u]);
    else
      e.resident += m.unit_bytes[u];
    largest_backward = std::max(largest_backward, m.backward_per_token[u]);
  }
  e.ring = e.slot * static_cast<uint64_t>(plan.ring_size);
  // Each taped unit's activations, from its forward to its backward.
  const std::vector<bool> taped = TapedBlocks(plan);
  for (size_t u = 0; u < taped.size(); ++u) {
    if (!taped[u]) continue;
    LS_CHECK(!plan.streamed[u] && m.expanded_bytes.empty(),
             "a streamed or compressed DiT unit is never taped");
    const uint64_t attentions = m.tape_attentions[u];
    const uint64_t tape =
        bt * (m.tape_per_token[u] + static_cast<uint64_t>(job.lora_rank) * m.tape_lora[u]) +
        (m.score_bytes > 0
             ? attentions * batch * static_cast<uint64_t>(m.heads) * t * t * m.score_bytes
             : 0);
    ++e.taped;
    e.tapes += tape;
    if (u + 1 == taped.size()) e.first_backward = tape;
  }
  e.forward_working = bt * m.forward_per_token;
  e.backward_working = bt * largest_backward + bt * m.stream_grads_per_token;
  const uint64_t heads = static_cast<uint64_t>(m.heads);
  e.attention = m.score_bytes > 0 ? batch * heads * t * t * m.score_bytes : batch * heads * t * 8;
  return e;
}

}  // namespace

std::string DitMemoryEstimate::Describe() const {
  std::ostringstream s;
  s << "rest " << FormatBytes(rest) << " + resident " << FormatBytes(resident) << " + ring "
    << FormatBytes(ring);
  if (expansion > 0) s << " + expansion scratch " << FormatBytes(expansion);
  s << " + adapter " << FormatBytes(adapter) << " + checkpoints " << FormatBytes(checkpoints)
    << " + working max(fwd " << FormatBytes(forward_working) << ", bwd "
    << FormatBytes(backward_working) << ") + attention " << FormatBytes(attention);
  if (taped > 0)
    s << " + activations of " << taped << " taped unit" << (taped == 1 ? "" : "s") << " "
      << FormatBytes(tapes) << " (" << FormatBytes(tapes - first_backward) << " in the backward)";
  s << " + reserve " << FormatBytes(reserve) << " = " << FormatBytes(total());
  return s.str();
}

bool SameDitShapes(const DitJob& job, const std::vector<DitJob>& group) {
  return std::all_of(group.begin(), group.end(), [&](const DitJob& o) {
    return o.batch == job.batch && o.image_tokens == job.image_tokens &&
           o.text_tokens == job.text_tokens && o.lora_params == job.lora_params &&
           o.lora_rank == job.lora_rank;
  });
}

DitMemoryEstimate EstimateDitMemory(const DitMemoryModel& m, const DitJob& job,
                                    const std::vector<DitJob>& group, const ResidencyPlan& plan) {
  LS_CHECK(plan.num_blocks() == static_cast<int>(m.unit_bytes.size()) &&
               m.unit_kind.size() == m.unit_bytes.size() &&
               m.backward_per_token.size() == m.unit_bytes.size() &&
               m.tape_per_token.size() == m.unit_bytes.size() &&
               m.tape_lora.size() == m.unit_bytes.size() &&
               m.tape_attentions.size() == m.unit_bytes.size(),
           "a DiT plan covers every unit");
  DitMemoryEstimate e = EstimateAlone(m, job, plan);
  for (const DitJob& other : group) {
    const DitMemoryEstimate j = EstimateAlone(m, other, plan);
    // Its streams' gradients live across the backward beside every other job's.
    const uint64_t stream_grads = static_cast<uint64_t>(other.batch) *
                                  static_cast<uint64_t>(other.image_tokens + other.text_tokens) *
                                  m.stream_grads_per_token;
    e.adapter += j.adapter;
    e.checkpoints += j.checkpoints + stream_grads;
    // Every job's tapes live together; the first backward unit frees one job's at a time.
    e.tapes += j.tapes;
    e.first_backward = std::min(e.first_backward, j.first_backward);
    if (m.group_stacked) {  // its rows go through each unit beside this job's
      e.forward_working += j.forward_working;
      e.backward_working += j.backward_working - stream_grads;  // counted with the checkpoints
      e.attention += j.attention;
    } else {
      e.forward_working = std::max(e.forward_working, j.forward_working);
      e.backward_working = std::max(e.backward_working, j.backward_working);
      e.attention = std::max(e.attention, j.attention);
    }
  }
  return e;
}

ResidencyPlan DitResidency(const DitMemoryModel& m, const std::vector<int>& streamed, int ring,
                           int taped) {
  const std::vector<int> counts = KindCounts(m);
  LS_CHECK(streamed.size() == counts.size(), "a DiT plan streams a count of every kind");
  std::vector<std::vector<bool>> per_kind;
  int total = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    per_kind.push_back(counts[k] == 0 ? std::vector<bool>{}
                                      : PlanFromSwapCount(counts[k], streamed[k], 1).streamed);
    total += streamed[k];
  }
  ResidencyPlan plan =
      PlanFromSwapCount(static_cast<int>(m.unit_kind.size()), total, std::max(1, ring));
  // Each kind's flags in the order its units come.
  std::vector<size_t> next(counts.size(), 0);
  for (size_t u = 0; u < m.unit_kind.size(); ++u) {
    const int k = m.unit_kind[u];
    plan.streamed[u] = per_kind[k][next[k]++];
  }
  plan.tape_resident_only = true;
  plan.taped_blocks =
      m.expanded_bytes.empty() ? std::clamp(taped, 0, plan.num_blocks() - plan.num_streamed()) : 0;
  return plan;
}

ResidencyPlan DitFillTapedUnits(const DitMemoryModel& m, const DitJob& job,
                                const std::vector<DitJob>& group, ResidencyPlan plan,
                                uint64_t budget_bytes) {
  plan.tape_resident_only = true;
  // A compressed unit's weights are expanded into one scratch that the next unit's use
  // overwrites: never taped.
  const int resident = m.expanded_bytes.empty() ? plan.num_blocks() - plan.num_streamed() : 0;
  // Each taped unit only adds to the estimate: the most that fit, by bisection.
  int lo = 0, hi = resident;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    plan.taped_blocks = mid;
    if (EstimateDitMemory(m, job, group, plan).total() <= budget_bytes)
      lo = mid;
    else
      hi = mid - 1;
  }
  plan.taped_blocks = lo;
  return plan;
}

ResidencyPlan DitSmallestPlan(const DitMemoryModel& m) { return DitResidency(m, KindCounts(m), 1); }

ResidencyPlan DitApplyTapedUnits(const DitMemoryModel& m, const DitJob& job,
                                 const std::vector<DitJob>& group, ResidencyPlan plan,
                                 uint64_t budget_bytes, int64_t taped, const std::string& key) {
  if (taped < -1)
    throw Error(ErrorCode::kRefused, key +
                                         " must be 0 (the plan's), -1 (as many as fit) or a "
                                         "count (found " +
                                         std::to_string(taped) + ")");
  plan.tape_resident_only = true;
  if (taped > 0) {
    const int resident = m.expanded_bytes.empty() ? plan.num_blocks() - plan.num_streamed() : 0;
    plan.taped_blocks = static_cast<int>(std::min<int64_t>(taped, resident));
  } else if (taped == -1) {
    plan.taped_blocks = 0;
    const uint64_t bound =
        budget_bytes > 0 ? budget_bytes : EstimateDitMemory(m, job, group, plan).total();
    plan = DitFillTapedUnits(m, job, group, plan, bound);
  }
  return plan;
}

std::string DitGroupBudgetRefusal(const DitMemoryModel& m, const DitJob& job,
                                  const std::vector<DitJob>& group, uint64_t budget_bytes) {
  const ResidencyPlan smallest = DitSmallestPlan(m);
  std::vector<DitJob> prefix;
  for (size_t j = 0; j <= group.size(); ++j) {
    if (j > 0) prefix.push_back(group[j - 1]);
    const uint64_t peak = EstimateDitMemory(m, job, prefix, smallest).total();
    if (peak <= budget_bytes) continue;
    const std::string name = j == 0 ? job.name : group[j - 1].name;
    return "job " + name + " does not fit in the " + m.family + " group" +
           (j == 0 ? std::string() : " beside the " + std::to_string(j) + " before it") +
           ": the group's smallest plan (every unit streamed, ring 1) needs " +
           FormatBytes(peak, 2) + ", " + FormatBytes(peak - budget_bytes, 2) + " (" +
           std::to_string(peak - budget_bytes) + " bytes) more than " + m.budget_key + " " +
           FormatBytes(budget_bytes, 2);
  }
  return "";
}

DitPlanning PlanDitUnits(uint64_t budget_bytes, bool predict, const ResidencyPlan& hand,
                         int64_t taped, const std::function<DitPlanInputs()>& inputs,
                         const std::function<StepCosts(int64_t)>& measure_job,
                         const std::function<std::vector<StepCosts>()>& measure_members) {
  DitPlanning p;
  if (budget_bytes == 0 && !predict) {
    p.plan = hand;
    if (taped != 0) {
      const DitPlanInputs in = inputs();
      p.plan =
          DitApplyTapedUnits(in.model, in.job, in.group, hand, 0, taped, "stream.taped_blocks");
    }
    return p;
  }
  const DitPlanInputs in = inputs();
  p.costs = measure_job(1);
  if (!in.group.empty()) {
    const size_t jobs = in.group.size() + 1;
    if (in.model.group_stacked && SameDitShapes(in.job, in.group)) {
      p.costs = StackedGroupCosts(p.costs, measure_job(static_cast<int64_t>(jobs)), jobs);
    } else {
      std::vector<StepCosts> each{p.costs};
      for (StepCosts& c : measure_members()) each.push_back(std::move(c));
      p.costs = GroupStepCosts(each);
    }
  }
  p.choice = PlanDitJob(in.model, in.job, in.group, p.costs, budget_bytes, hand, taped);
  p.plan = p.choice.candidates[p.choice.chosen].plan;
  return p;
}

std::string DitPlanLabel(const DitMemoryModel& m, const ResidencyPlan& plan) {
  std::vector<int> streamed(Kinds(m), 0);
  for (size_t u = 0; u < m.unit_kind.size(); ++u)
    if (plan.streamed[u]) ++streamed[m.unit_kind[u]];
  std::ostringstream s;
  s << "swap " << plan.num_streamed();
  if (m.kind_names.size() > 1) {
    s << " (";
    for (size_t k = 0; k < streamed.size(); ++k)
      s << (k > 0 ? ", " : "") << m.kind_names[k] << " " << streamed[k];
    s << ")";
  }
  s << " ring " << plan.ring_size;
  if (plan.taped_blocks > 0) s << " taped " << plan.taped_blocks;
  return s.str();
}

PlanChoice ChooseDitPlan(const DitMemoryModel& m, const DitJob& job,
                         const std::vector<DitJob>& group, const StepCosts& costs,
                         uint64_t budget_bytes, int max_ring) {
  const std::vector<int> counts = KindCounts(m);
  const int units = static_cast<int>(m.unit_kind.size());
  std::vector<CandidatePlan> all;
  uint64_t minimum = UINT64_MAX;
  // Every split, the first kind's count outermost.
  std::vector<int> split(counts.size(), 0);
  for (bool more = true; more;) {
    int n = 0;
    for (int s : split) n += s;
    for (int ring = 1; ring <= (n == 0 ? 1 : max_ring); ++ring) {
      if (ring > n && ring > 1) break;
      CandidatePlan c;
      c.plan = DitResidency(m, split, ring);
      c.peak_bytes = EstimateDitMemory(m, job, group, c.plan).total();
      c.fits = c.peak_bytes <= budget_bytes;
      minimum = std::min(minimum, c.peak_bytes);
      if (!c.fits && n < units) continue;  // kept: the all-streamed plans
      c.predicted = PredictStep(c.plan, m.unit_bytes, costs);
      // The budget's headroom as taped units: their forward is not recomputed.
      CandidatePlan taped;
      if (c.fits) {
        taped.plan = DitFillTapedUnits(m, job, group, c.plan, budget_bytes);
        if (taped.plan.taped_blocks > 0) {
          taped.peak_bytes = EstimateDitMemory(m, job, group, taped.plan).total();
          taped.fits = true;
          taped.predicted = PredictStep(taped.plan, m.unit_bytes, costs);
        }
      }
      all.push_back(std::move(c));
      if (taped.plan.taped_blocks > 0) all.push_back(std::move(taped));
    }
    more = false;
    for (int k = static_cast<int>(split.size()) - 1; k >= 0; --k) {
      if (split[k] < counts[k]) {
        ++split[k];
        more = true;
        break;
      }
      split[k] = 0;
    }
  }
  const int best = PickPlan(all);
  if (best < 0)
    throw Error(ErrorCode::kRefused,
                m.budget_key + " " + FormatBytes(budget_bytes) +
                    " is below the smallest plan's estimate (every unit streamed through one "
                    "slot): " +
                    FormatBytes(minimum) + "; raise it, or lower " + m.batch_key);
  // The table: per streamed-unit count its fastest fitting candidate (else its smallest), and
  // the chosen one.
  PlanChoice choice;
  std::vector<int> per_count(m.unit_kind.size() + 1, -1);
  for (int i = 0; i < static_cast<int>(all.size()); ++i) {
    const int n = all[i].plan.num_streamed();
    int& k = per_count[n];
    const bool better =
        k < 0 || (all[i].fits && !all[k].fits) ||
        (all[i].fits == all[k].fits &&
         (all[i].fits ? all[i].predicted.step_seconds < all[k].predicted.step_seconds
                      : all[i].peak_bytes < all[k].peak_bytes));
    if (better) k = i;
  }
  per_count[all[best].plan.num_streamed()] = best;
  for (int k : per_count) {
    if (k < 0) continue;
    if (k == best) choice.chosen = static_cast<int>(choice.candidates.size());
    choice.candidates.push_back(all[k]);
  }
  return choice;
}

PlanChoice PlanDitJob(const DitMemoryModel& m, const DitJob& job, const std::vector<DitJob>& group,
                      const StepCosts& costs, uint64_t budget_bytes, const ResidencyPlan& hand,
                      int64_t taped) {
  PlanChoice choice;
  if (budget_bytes > 0) {
    if (!group.empty())
      if (const std::string why = DitGroupBudgetRefusal(m, job, group, budget_bytes); !why.empty())
        throw Error(ErrorCode::kRefused, why);
    choice = ChooseDitPlan(m, job, group, costs, budget_bytes);
  } else {
    CandidatePlan c;
    c.plan = hand;
    choice.candidates.push_back(c);
    choice.chosen = 0;
  }
  CandidatePlan& c = choice.candidates[choice.chosen];
  if (budget_bytes == 0 || taped != 0) {
    c.plan = DitApplyTapedUnits(m, job, group, c.plan, budget_bytes, taped, "stream.taped_blocks");
    c.peak_bytes = EstimateDitMemory(m, job, group, c.plan).total();
    c.fits = budget_bytes == 0 || c.peak_bytes <= budget_bytes;
    c.predicted = PredictStep(c.plan, m.unit_bytes, costs);
  }
  return choice;
}

std::string DescribeDitPlanning(const DitMemoryModel& m, const DitJob& job,
                                const std::vector<DitJob>& group, const PlanChoice& choice,
                                const StepCosts& costs, uint64_t budget) {
  std::ostringstream s;
  const double bw = costs.h2d_bytes_per_second;
  s << (budget > 0 ? "budget " + FormatBytes(budget) : std::string("no budget: the job's plan"))
    << "; H2D " << bw / 1e9 << " GB/s\n";
  s << "  plan                                   resident  taped  predicted ms  copied GB  floor "
       "ms  stall ms  peak GiB  fits\n";
  for (int i = 0; i < static_cast<int>(choice.candidates.size()); ++i) {
    const CandidatePlan& c = choice.candidates[i];
    char line[256];
    std::snprintf(line, sizeof line, "%s %-38s %8d  %5d  %12.1f  %9.2f  %8.1f  %8.1f  %8.2f  %s\n",
                  i == choice.chosen ? "*" : " ", DitPlanLabel(m, c.plan).c_str(),
                  c.plan.num_blocks() - c.plan.num_streamed(), c.plan.taped_blocks,
                  c.predicted.step_seconds * 1e3, c.predicted.h2d_bytes / 1e9,
                  bw > 0 ? c.predicted.h2d_bytes / bw * 1e3 : 0.0, c.predicted.stall_seconds * 1e3,
                  c.peak_bytes / double(1ULL << 30), c.fits ? "yes" : "no");
    s << line;
  }
  if (choice.chosen >= 0) {
    const CandidatePlan& c = choice.candidates[choice.chosen];
    const ResidencyPlan resident = DitResidency(m, std::vector<int>(Kinds(m), 0), 1);
    const double resident_s = PredictStep(resident, m.unit_bytes, costs).step_seconds;
    const double floor_s = bw > 0 ? c.predicted.h2d_bytes / bw : 0.0;
    char line[512];
    std::snprintf(line, sizeof line,
                  "chosen: %s; predicted %.1f ms per step, PCIe floor %.1f ms, resident step "
                  "%.1f ms (resident peak %.2f GiB)\n",
                  DitPlanLabel(m, c.plan).c_str(), c.predicted.step_seconds * 1e3, floor_s * 1e3,
                  resident_s * 1e3,
                  EstimateDitMemory(m, job, group, resident).total() / double(1ULL << 30));
    s << line << "estimate: " << EstimateDitMemory(m, job, group, c.plan).Describe() << "\n";
    std::snprintf(line, sizeof line,
                  "plan-summary streamed=%d ring=%d taped=%d predicted_ms=%.3f floor_ms=%.3f "
                  "resident_ms=%.3f peak_gib=%.3f\n",
                  c.plan.num_streamed(), c.plan.ring_size, c.plan.taped_blocks,
                  c.predicted.step_seconds * 1e3, floor_s * 1e3, resident_s * 1e3,
                  c.peak_bytes / double(1ULL << 30));
    s << line;
  }
  return s.str();
}

}  // namespace lorastream::worker
