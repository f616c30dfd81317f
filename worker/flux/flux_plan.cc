#include "worker/flux/flux_plan.h"

namespace lorastream::worker::flux {

DitMemoryModel FluxMemoryModel(const FluxMemoryInputs& in) {
  const FluxConfig& c = in.config;
  const uint64_t b = static_cast<uint64_t>(in.compute_bytes);
  const uint64_t h = static_cast<uint64_t>(c.hidden_size), m = static_cast<uint64_t>(c.mlp_hidden);
  DitMemoryModel out;
  out.kind_names = {"double", "single"};
  out.unit_bytes = in.unit_bytes;
  out.expanded_bytes = in.expanded_bytes;
  out.rest_bytes = in.rest_bytes;
  out.reserve_bytes = in.reserve_bytes;
  out.checkpoint_per_token = in.units.size() * h * b;
  out.table_per_token = static_cast<uint64_t>(c.head_dim()) * 8;  // f32 [.., 2, 2] pairs
  out.forward_per_token = DualStreamForwardPerToken(h, m, b, in.fused_heads);
  for (const FluxUnit& unit : in.units) {
    out.unit_kind.push_back(unit.is_double ? 0 : 1);
    const uint64_t per_block = unit.is_double
                                   ? DualStreamBackwardPerToken(h, m, b, in.fused_heads)
                                   : b * (15 * h + 5 * m) + QkF32Copies(h, in.fused_heads);
    out.backward_per_token.push_back(per_block * static_cast<uint64_t>(unit.count));
    // Taped: a double block's token-wise linears are qkv, proj and the MLP's two (per stream);
    // a single block's linear1 and linear2.
    const uint64_t heads = static_cast<uint64_t>(c.num_heads),
                   count = static_cast<uint64_t>(unit.count);
    out.tape_per_token.push_back(
        count * (unit.is_double ? DualStreamTapePerToken(h, m, b, heads, in.fused_heads)
                                : SingleStreamTapePerToken(h, m, b, heads, in.fused_heads)));
    out.tape_lora.push_back(count * b * (unit.is_double ? 4 : 2));
    out.tape_attentions.push_back(count);
  }
  out.stream_grads_per_token = 2 * h * b;
  out.heads = c.num_heads;
  out.score_bytes = in.attention_materialized ? 2 * b : 0;
  out.group_stacked = in.group_stacked;
  out.budget_key = "flux.gpu_memory_budget";
  out.batch_key = "flux.batch_size";
  out.family = "FLUX";
  return out;
}

DitJob FluxDitJob(const FluxMemoryInputs& in, const std::string& name) {
  return {name,         in.lora_params,        in.batch, in.image_tokens, in.text_tokens,
          in.lora_rank, in.eight_bit_optimizer};
}

FluxMemoryEstimate EstimateFluxMemory(const FluxMemoryInputs& in, const ResidencyPlan& plan) {
  return EstimateDitMemory(FluxMemoryModel(in), FluxDitJob(in), in.group, plan);
}

std::string FluxGroupBudgetRefusal(const FluxMemoryInputs& in, uint64_t budget_bytes,
                                   const std::string& first_name) {
  return DitGroupBudgetRefusal(FluxMemoryModel(in), FluxDitJob(in, first_name), in.group,
                               budget_bytes);
}

ResidencyPlan FluxResidency(const FluxMemoryInputs& in, int doubles, int singles, int ring) {
  return DitResidency(FluxMemoryModel(in), {doubles, singles}, ring);
}

std::vector<double> FluxBlockScale(const FluxMemoryInputs& in, double single_to_double) {
  std::vector<double> out;
  for (const auto& u : in.units)
    out.push_back(u.is_double ? 1.0 : single_to_double * static_cast<double>(u.count));
  return out;
}

PlanChoice ChooseFluxPlan(const FluxMemoryInputs& in, const StepCosts& costs, uint64_t budget_bytes,
                          int max_ring) {
  return ChooseDitPlan(FluxMemoryModel(in), FluxDitJob(in), in.group, costs, budget_bytes,
                       max_ring);
}

}  // namespace lorastream::worker::flux
