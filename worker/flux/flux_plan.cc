#include "worker/flux/flux_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "common/error.h"
#include "common/format_bytes.h"

namespace lorastream::worker::flux {

namespace {

// The resident flags of `count` units of one kind with `streamed` of them streamed.
std::vector<bool> Spread(int count, int streamed) {
  if (count == 0) return {};
  return PlanFromSwapCount(count, streamed, 1).streamed;
}

}  // namespace

std::string FluxMemoryEstimate::Describe() const {
  std::ostringstream s;
  s << "rest " << FormatBytes(rest) << " + resident " << FormatBytes(resident) << " + ring "
    << FormatBytes(ring);
  if (expansion > 0) s << " + expansion scratch " << FormatBytes(expansion);
  s << " + adapter " << FormatBytes(adapter) << " + checkpoints " << FormatBytes(checkpoints)
    << " + working max(fwd " << FormatBytes(forward_working) << ", bwd "
    << FormatBytes(backward_working) << ") + attention " << FormatBytes(attention) << " + reserve "
    << FormatBytes(reserve) << " = " << FormatBytes(total());
  return s.str();
}

FluxMemoryEstimate EstimateFluxMemory(const FluxMemoryInputs& in, const ResidencyPlan& plan) {
  LS_CHECK(plan.num_blocks() == static_cast<int>(in.units.size()) &&
               in.unit_bytes.size() == in.units.size(),
           "a FLUX plan covers every unit");
  const FluxConfig& c = in.config;
  const uint64_t b = static_cast<uint64_t>(in.compute_bytes);
  const uint64_t h = static_cast<uint64_t>(c.hidden_size), m = static_cast<uint64_t>(c.mlp_hidden);
  const uint64_t bt = static_cast<uint64_t>(in.batch * (in.image_tokens + in.text_tokens));
  FluxMemoryEstimate e;
  e.rest = in.rest_bytes;
  e.reserve = in.reserve_bytes;
  e.adapter = static_cast<uint64_t>(in.lora_params) * 16;
  e.checkpoints = in.units.size() * bt * h * b + bt * static_cast<uint64_t>(c.head_dim()) * 8;
  uint64_t largest_unit_working = 0;
  for (size_t u = 0; u < in.units.size(); ++u) {
    // A compressed unit holds its compressed bytes, resident or in a slot; its uses share one
    // expansion scratch.
    if (!in.expanded_bytes.empty()) e.expansion = std::max(e.expansion, in.expanded_bytes[u]);
    if (plan.streamed[u])
      e.slot = std::max(e.slot, in.unit_bytes[u]);
    else
      e.resident += in.unit_bytes[u];
    const FluxUnit& unit = in.units[u];
    const uint64_t per_block = unit.is_double ? bt * (b * (20 * h + 4 * m) + 32 * h)
                                              : bt * (b * (15 * h + 5 * m) + 32 * h);
    largest_unit_working =
        std::max(largest_unit_working, per_block * static_cast<uint64_t>(unit.count));
  }
  e.ring = e.slot * static_cast<uint64_t>(plan.ring_size);
  e.forward_working = bt * (b * (6 * h + 2 * m) + 32 * h);
  e.backward_working = largest_unit_working + 2 * bt * h * b;
  const uint64_t heads = static_cast<uint64_t>(c.num_heads);
  const uint64_t t = static_cast<uint64_t>(in.image_tokens + in.text_tokens);
  e.attention = in.attention_materialized ? static_cast<uint64_t>(in.batch) * heads * t * t * 2 * b
                                          : static_cast<uint64_t>(in.batch) * heads * t * 8;
  AddFluxGroupMemory(in, plan, e);
  return e;
}

void AddFluxGroupMemory(const FluxMemoryInputs& in, const ResidencyPlan& plan,
                        FluxMemoryEstimate& e) {
  for (const FluxGroupMember& m : in.group) {
    FluxMemoryInputs alone = in;
    alone.group.clear();
    alone.lora_params = m.lora_params;
    alone.batch = m.batch;
    alone.image_tokens = m.image_tokens;
    alone.text_tokens = m.text_tokens;
    const FluxMemoryEstimate j = EstimateFluxMemory(alone, plan);
    // Its streams' gradients live across the backward beside every other job's.
    const uint64_t stream_grads =
        2 * static_cast<uint64_t>(m.batch) * static_cast<uint64_t>(m.image_tokens + m.text_tokens) *
        static_cast<uint64_t>(in.config.hidden_size) * static_cast<uint64_t>(in.compute_bytes);
    e.adapter += j.adapter;
    e.checkpoints += j.checkpoints + stream_grads;
    e.forward_working = std::max(e.forward_working, j.forward_working);
    e.backward_working = std::max(e.backward_working, j.backward_working);
    e.attention = std::max(e.attention, j.attention);
  }
}

std::string FluxGroupBudgetRefusal(const FluxMemoryInputs& in, uint64_t budget_bytes,
                                   const std::string& first_name) {
  int n_double = 0;
  for (const auto& u : in.units) n_double += u.is_double ? 1 : 0;
  const ResidencyPlan smallest =
      FluxResidency(in, n_double, static_cast<int>(in.units.size()) - n_double, 1);
  FluxMemoryInputs prefix = in;
  prefix.group.clear();
  for (size_t j = 0; j <= in.group.size(); ++j) {
    if (j > 0) prefix.group.push_back(in.group[j - 1]);
    const uint64_t peak = EstimateFluxMemory(prefix, smallest).total();
    if (peak <= budget_bytes) continue;
    const std::string name = j == 0 ? first_name : in.group[j - 1].name;
    return "job " + name + " does not fit in the FLUX group" +
           (j == 0 ? std::string() : " beside the " + std::to_string(j) + " before it") +
           ": the group's smallest plan (every unit streamed, ring 1) needs " +
           FormatBytes(peak, 2) + ", " + FormatBytes(peak - budget_bytes, 2) + " (" +
           std::to_string(peak - budget_bytes) + " bytes) more than flux.gpu_memory_budget " +
           FormatBytes(budget_bytes, 2);
  }
  return "";
}

ResidencyPlan FluxResidency(const FluxMemoryInputs& in, int doubles, int singles, int ring) {
  int n_double = 0;
  for (const auto& u : in.units) n_double += u.is_double ? 1 : 0;
  const int n_single = static_cast<int>(in.units.size()) - n_double;
  std::vector<bool> streamed = Spread(n_double, doubles);
  const std::vector<bool> s = Spread(n_single, singles);
  streamed.insert(streamed.end(), s.begin(), s.end());
  ResidencyPlan plan =
      PlanFromSwapCount(static_cast<int>(in.units.size()), doubles + singles, std::max(1, ring));
  plan.streamed = streamed;
  return plan;
}

std::vector<double> FluxBlockScale(const FluxMemoryInputs& in, double single_to_double) {
  std::vector<double> out;
  for (const auto& u : in.units)
    out.push_back(u.is_double ? 1.0 : single_to_double * static_cast<double>(u.count));
  return out;
}

std::string FluxPlanLabel(const FluxMemoryInputs& in, const ResidencyPlan& plan) {
  int doubles = 0, singles = 0;
  for (size_t u = 0; u < in.units.size(); ++u)
    if (plan.streamed[u]) ++(in.units[u].is_double ? doubles : singles);
  std::ostringstream s;
  s << "swap " << doubles + singles << " (double " << doubles << ", single " << singles << ") ring "
    << plan.ring_size;
  return s.str();
}

PlanChoice ChooseFluxPlan(const FluxMemoryInputs& in, const StepCosts& costs, uint64_t budget_bytes,
                          int max_ring) {
  int n_double = 0;
  for (const auto& u : in.units) n_double += u.is_double ? 1 : 0;
  const int n_single = static_cast<int>(in.units.size()) - n_double;
  std::vector<CandidatePlan> all;
  uint64_t minimum = UINT64_MAX;
  for (int d = 0; d <= n_double; ++d)
    for (int s = 0; s <= n_single; ++s)
      for (int ring = 1; ring <= (d + s == 0 ? 1 : max_ring); ++ring) {
        if (ring > d + s && ring > 1) break;
        CandidatePlan c;
        c.plan = FluxResidency(in, d, s, ring);
        c.peak_bytes = EstimateFluxMemory(in, c.plan).total();
        c.fits = c.peak_bytes <= budget_bytes;
        minimum = std::min(minimum, c.peak_bytes);
        if (!c.fits && d + s < n_double + n_single) continue;  // kept: the all-streamed plans
        c.predicted = PredictStep(c.plan, in.unit_bytes, costs);
        all.push_back(std::move(c));
      }
  const int best = PickPlan(all);
  if (best < 0)
    throw Error(ErrorCode::kRefused,
                "flux.gpu_memory_budget " + FormatBytes(budget_bytes) +
                    " is below the smallest plan's estimate (every unit streamed through one "
                    "slot): " +
                    FormatBytes(minimum) + "; raise it, or lower flux.batch_size");
  // The table: per streamed-unit count its fastest fitting candidate (else its smallest), and
  // the chosen one.
  PlanChoice choice;
  std::vector<int> per_count(in.units.size() + 1, -1);
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

}  // namespace lorastream::worker::flux
