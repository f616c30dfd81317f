#include "worker/stream/stream_cost.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

double StepCosts::ResidentStepSeconds(int num_blocks) const {
  // A compressed block expands at each use but the turnaround's second.
  const double expansions = block_expand_seconds > 0 ? 2.0 * num_blocks - 1 : 0.0;
  return (num_blocks * (block_forward_seconds + block_backward_seconds) +
          expansions * block_expand_seconds + head_seconds + tail_seconds) *
         graph_factor;
}

StepCosts GroupStepCosts(const std::vector<StepCosts>& jobs) {
  LS_CHECK(!jobs.empty(), "a group's costs need at least one job's");
  StepCosts group = jobs.front();
  for (size_t j = 1; j < jobs.size(); ++j) {
    group.block_forward_seconds += jobs[j].block_forward_seconds;
    group.block_backward_seconds += jobs[j].block_backward_seconds;
    group.head_seconds += jobs[j].head_seconds;
    group.tail_seconds += jobs[j].tail_seconds;
  }
  return group;
}

StepCosts StackedGroupCosts(const StepCosts& one, const StepCosts& stacked, size_t jobs) {
  StepCosts group = one;
  group.block_forward_seconds = stacked.block_forward_seconds;
  group.block_backward_seconds = stacked.block_backward_seconds;
  group.head_seconds = stacked.head_seconds;
  group.tail_seconds = one.tail_seconds * static_cast<double>(jobs);
  return group;
}

std::string StepCosts::Describe() const {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "block forward %.2f ms, block recompute+backward %.2f ms, head %.2f ms, tail "
                "%.2f ms, H2D %.1f GB/s",
                block_forward_seconds * 1e3, block_backward_seconds * 1e3, head_seconds * 1e3,
                tail_seconds * 1e3, h2d_bytes_per_second / 1e9);
  std::string out = buf;
  if (block_expand_seconds > 0) {
    std::snprintf(buf, sizeof buf, ", expanding a compressed block %.2f ms",
                  block_expand_seconds * 1e3);
    out += buf;
  }
  if (graph_factor != 1) {
    std::snprintf(buf, sizeof buf, ", a step streaming nothing as a CUDA graph x%.3f",
                  graph_factor);
    out += buf;
  }
  return out;
}

void SplitMeasuredSteps(double deep_step, int deep, double short_step, int half,
                        double forward_share, StepCosts* costs, double tail_floor) {
  LS_CHECK(deep > half && half >= 0, "the calibration's two depths");
  double per_block = std::max(0.0, (deep_step - short_step) / (deep - half));
  double tail = short_step - half * per_block - costs->head_seconds;
  if (tail < tail_floor) {
    tail = std::clamp(tail_floor, 0.0, std::max(0.0, deep_step - costs->head_seconds));
    per_block = std::max(0.0, (deep_step - costs->head_seconds - tail) / deep);
  }
  const double share = std::clamp(forward_share, 0.0, 1.0);
  costs->block_forward_seconds = per_block * share;
  costs->block_backward_seconds = per_block - costs->block_forward_seconds;
  costs->tail_seconds = tail;
}

PredictedStep PredictStep(const ResidencyPlan& plan, const std::vector<uint64_t>& block_bytes,
                          const StepCosts& costs, uint64_t head_bytes) {
  const int num_blocks = plan.num_blocks();
  LS_CHECK(static_cast<int>(block_bytes.size()) == num_blocks, "block sizes and plan differ");
  LS_CHECK(costs.block_scale.empty() || static_cast<int>(costs.block_scale.size()) == num_blocks,
           "block scales and plan differ");
  LS_CHECK(costs.block_expand_scale.empty() ||
               static_cast<int>(costs.block_expand_scale.size()) == num_blocks,
           "block expansion scales and plan differ");
  const double bandwidth = costs.h2d_bytes_per_second;
  const std::vector<bool> taped_blocks = TapedBlocks(plan);
  std::vector<int> slots(plan.max_slots(), -1);
  std::vector<double> slot_ready(plan.max_slots(), 0.0);  // when the slot's last copy lands
  double compute = 0, copy = 0, last_release = 0;
  PredictedStep step;
  // The first pass starts from an empty ring; the slots' contents converge within two
  // passes (PlanSteadyPass), so the fourth pass is the steady step.
  for (int pass = 0; pass < 4; ++pass) {
    const PassPlan p = PlanPass(plan, slots);
    PredictedStep now;
    const double start = compute;
    // One copy on the FIFO copy engine, issued at `ready`; returns when it lands.
    auto copy_bytes = [&](uint64_t bytes, double ready) {
      const double seconds = bandwidth > 0 ? bytes / bandwidth : 0.0;
      copy = std::max(copy, ready) + seconds;
      now.copy_busy_seconds += seconds;
      now.h2d_bytes += bytes;
      return copy;
    };
    auto issue = [&](int u, double ready) {
      const BlockUse& use = p.uses[u];
      slot_ready[use.slot] = copy_bytes(block_bytes[use.block], ready);
    };
    for (int u : p.issue_at_start) issue(u, last_release);
    double head_landed = -1;  // when a streamed head's copy lands, once issued
    for (int u = 0; u < static_cast<int>(p.uses.size()); ++u) {
      if (u == num_blocks) {
        if (plan.head_streamed) {
          if (head_landed < 0) head_landed = copy_bytes(head_bytes, compute);
          now.stall_seconds += std::max(0.0, head_landed - compute);
          compute = std::max(compute, head_landed);
        }
        compute += costs.head_seconds;
      }
      for (int d : p.issue_at_acquire[u]) issue(d, compute);
      const BlockUse& use = p.uses[u];
      double begin = compute;
      if (use.slot >= 0) begin = std::max(begin, slot_ready[use.slot]);
      now.stall_seconds += begin - compute;
      // A taped block's backward runs without its recompute.
      const bool taped = taped_blocks[use.block];
      // A compressed block expands at every use but the turnaround (the engine's scratch
      // still holds it). Blocks of several sizes (FLUX's units) scale the measured block's
      // compute.
      const bool expands = u == 0 || p.uses[u - 1].block != use.block;
      const double scale = costs.block_scale.empty() ? 1.0 : costs.block_scale[use.block];
      const double expand_scale =
          costs.block_expand_scale.empty() ? 1.0 : costs.block_expand_scale[use.block];
      compute =
          begin + (expands ? costs.block_expand_seconds * expand_scale : 0.0) +
          scale * (!use.backward ? costs.block_forward_seconds
                   : taped
                       ? std::max(0.0, costs.block_backward_seconds - costs.block_forward_seconds)
                       : costs.block_backward_seconds);
      for (int r : p.issue_after_release[u]) issue(r, compute);
      if (u == p.head_copy_after && plan.head_streamed)
        head_landed = copy_bytes(head_bytes, compute);
    }
    last_release = compute;
    compute += costs.tail_seconds;
    now.step_seconds = compute - start;
    slots = p.slots_at_end;
    step = now;
  }
  if (plan.num_streamed() == 0 && !plan.head_streamed) step.step_seconds *= costs.graph_factor;
  return step;
}

double OptimizerStepSeconds(double pass_seconds, const StepCosts& costs, int64_t grad_accum) {
  const int64_t passes = std::max<int64_t>(1, grad_accum);
  return static_cast<double>(passes) * pass_seconds -
         static_cast<double>(passes - 1) * costs.tail_seconds;
}

std::string CandidatePlan::Label() const {
  std::ostringstream s;
  s << "swap " << plan.num_streamed() << " ring " << plan.ring_size;
  if (plan.forward_slots != plan.ring_size || plan.backward_slots != plan.ring_size ||
      plan.head_slots != plan.ring_size)
    s << " fwd " << plan.forward_slots << " head " << plan.head_slots << " bwd "
      << plan.backward_slots;
  if (plan.head_streamed) s << " head streamed";
  if (plan.taped_blocks > 0) s << " taped " << plan.taped_blocks;
  return s.str();
}

namespace {

// Same slots per phase and taped blocks (the residency of two plans from one hand plan is the
// same).
bool SameMemoryPlan(const ResidencyPlan& a, const ResidencyPlan& b) {
  return a.forward_slots == b.forward_slots && a.backward_slots == b.backward_slots &&
         a.head_slots == b.head_slots && a.taped_blocks == b.taped_blocks;
}

}  // namespace

int PickPlan(const std::vector<CandidatePlan>& candidates) {
  double fastest = -1;
  for (const CandidatePlan& c : candidates)
    if (c.fits && (fastest < 0 || c.predicted.step_seconds < fastest))
      fastest = c.predicted.step_seconds;
  // Of the plans predicted within kPlanTieFraction of the fastest (a difference the
  // prediction cannot tell from noise): the fewest bytes over the link, then the fewest slots
  // (a phase slot is memory handed back and forth with the allocator every step), then the
  // lower peak, then the faster.
  const auto key = [](const CandidatePlan& p) {
    return std::make_tuple(p.predicted.h2d_bytes, p.plan.max_slots(), p.peak_bytes,
                           p.predicted.step_seconds);
  };
  int chosen = -1;
  for (int i = 0; i < static_cast<int>(candidates.size()); ++i) {
    const CandidatePlan& c = candidates[i];
    if (!c.fits || c.predicted.step_seconds > fastest * (1 + kPlanTieFraction)) continue;
    if (chosen < 0 || key(c) < key(candidates[chosen])) chosen = i;
  }
  return chosen;
}

PlanChoice ChoosePlan(const MemoryModelInputs& inputs, const StepCosts& costs,
                      uint64_t budget_bytes, int max_ring) {
  const int num_blocks = static_cast<int>(inputs.block_bytes.size());
  PlanChoice choice;
  auto add = [&](const ResidencyPlan& plan) {
    CandidatePlan c;
    c.plan = plan;
    c.peak_bytes = EstimateMemory(inputs, plan).total();
    c.predicted = PredictStep(plan, inputs.block_bytes, costs, inputs.head_bytes);
    c.fits = c.peak_bytes <= budget_bytes;
    choice.candidates.push_back(std::move(c));
  };
  for (bool head_streamed : {false, true}) {
    if (head_streamed && inputs.head_bytes == 0) break;  // nothing to stream
    for (int swap = 0; swap <= num_blocks; ++swap) {
      for (int ring = 1; ring <= std::max(1, max_ring); ++ring) {
        if (ring > std::max(swap, 1)) break;  // the same plan again
        ResidencyPlan hand = PlanFromSwapCount(num_blocks, swap, ring);
        hand.head_streamed = head_streamed;
        add(hand);
        // The budget's headroom as phase slots, as taped blocks, or both (either first).
        const ResidencyPlan filled = FillPhaseSlots(inputs, hand, budget_bytes);
        const ResidencyPlan taped = FillTapedBlocks(inputs, hand, budget_bytes);
        std::vector<ResidencyPlan> from_hand = {hand};
        for (const ResidencyPlan& p : {filled, taped, FillTapedBlocks(inputs, filled, budget_bytes),
                                       FillPhaseSlots(inputs, taped, budget_bytes)}) {
          const auto same = [&](const ResidencyPlan& q) { return SameMemoryPlan(p, q); };
          if (std::none_of(from_hand.begin(), from_hand.end(), same)) {
            from_hand.push_back(p);
            add(p);
          }
        }
      }
    }
  }
  const CandidatePlan* smallest = nullptr;
  for (const CandidatePlan& c : choice.candidates)
    if (!smallest || c.peak_bytes < smallest->peak_bytes) smallest = &c;
  choice.chosen = PickPlan(choice.candidates);
  if (choice.chosen < 0) {
    const uint64_t minimum = smallest ? smallest->peak_bytes : 0;
    throw Error(ErrorCode::kRefused,
                "stream.gpu_memory_budget " + std::to_string(budget_bytes) + " bytes (" +
                    FormatBytes(budget_bytes) + ") is below the minimum of " +
                    std::to_string(minimum) + " bytes (" + FormatBytes(minimum) +
                    ") of every plan considered: raise gpu_memory_budget to at least " +
                    std::to_string(minimum) + ", or lower seq_len or batch_size" +
                    (smallest ? AdapterStateHint(EstimateMemory(inputs, smallest->plan)) : ""));
  }
  return choice;
}

std::string DescribeChoice(const PlanChoice& choice, uint64_t budget_bytes) {
  std::ostringstream s;
  s << "budget " << FormatBytes(budget_bytes) << "\n"
    << "  plan                                                 resident  predicted ms  copied GB  "
       "stall ms  peak GiB  fits\n";
  for (int i = 0; i < static_cast<int>(choice.candidates.size()); ++i) {
    const CandidatePlan& c = choice.candidates[i];
    char line[256];
    std::snprintf(line, sizeof line, "%s %-52s %8d  %12.1f  %9.2f  %8.1f  %8.2f  %s\n",
                  i == choice.chosen ? "*" : " ", c.Label().c_str(),
                  c.plan.num_blocks() - c.plan.num_streamed(), c.predicted.step_seconds * 1e3,
                  c.predicted.h2d_bytes / 1e9, c.predicted.stall_seconds * 1e3,
                  c.peak_bytes / double(1ULL << 30), c.fits ? "yes" : "no");
    s << line;
  }
  if (choice.chosen >= 0) {
    const CandidatePlan& c = choice.candidates[choice.chosen];
    char line[256];
    std::snprintf(line, sizeof line, "chosen: %s, predicted %.1f ms per step, peak %.2f GiB\n",
                  c.Label().c_str(), c.predicted.step_seconds * 1e3,
                  c.peak_bytes / double(1ULL << 30));
    s << line;
  }
  return s.str();
}

std::string CalibrationCachePath(const std::string& key) {
  std::string dir;
  if (const char* d = std::getenv("LORASTREAM_CACHE_DIR"); d && *d) {
    dir = d;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    dir = std::string(x) + "/lorastream";
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    dir = std::string(h) + "/.cache/lorastream";
  } else {
    dir = "/tmp/lorastream-cache";
  }
  std::string file;
  for (char c : key)
    file +=
        (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_') ? c : '_';
  return dir + "/calibration/" + file + ".json";
}

bool LoadStepCosts(const std::string& key, StepCosts* costs) {
  std::ifstream in(CalibrationCachePath(key));
  if (!in) return false;
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  StepCosts c;
  const std::pair<const char*, double*> fields[] = {
      {"block_forward_seconds", &c.block_forward_seconds},
      {"block_backward_seconds", &c.block_backward_seconds},
      {"head_seconds", &c.head_seconds},
      {"tail_seconds", &c.tail_seconds},
      {"h2d_bytes_per_second", &c.h2d_bytes_per_second}};
  if (!j.is_object() || j.value("key", std::string()) != key) return false;
  for (const auto& [name, field] : fields) {
    if (!j.contains(name) || !j[name].is_number() || j[name].get<double>() < 0) return false;
    *field = j[name].get<double>();
  }
  if (j.contains("block_expand_seconds")) {  // absent: a plain store's entry
    if (!j["block_expand_seconds"].is_number() || j["block_expand_seconds"].get<double>() < 0)
      return false;
    c.block_expand_seconds = j["block_expand_seconds"].get<double>();
  }
  if (j.contains("graph_factor")) {
    if (!j["graph_factor"].is_number() || !(j["graph_factor"].get<double>() > 0)) return false;
    c.graph_factor = j["graph_factor"].get<double>();
  }
  *costs = c;
  return true;
}

void SaveStepCosts(const std::string& key, const StepCosts& c) {
  const fs::path path = CalibrationCachePath(key);
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  nlohmann::json j = {{"key", key},
                      {"block_forward_seconds", c.block_forward_seconds},
                      {"block_backward_seconds", c.block_backward_seconds},
                      {"head_seconds", c.head_seconds},
                      {"tail_seconds", c.tail_seconds},
                      {"h2d_bytes_per_second", c.h2d_bytes_per_second},
                      {"graph_factor", c.graph_factor},
                      {"block_expand_seconds", c.block_expand_seconds}};
  // Written whole then renamed: a reader never sees half a file.
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) {
      LS_LOG_WARN("stream: cannot write the calibration cache {} (measured again next time)",
                  tmp.string());
      return;
    }
  }
  fs::rename(tmp, path, ec);
  if (ec)
    LS_LOG_WARN("stream: cannot write the calibration cache {}: {}", path.string(), ec.message());
}

}  // namespace lorastream::worker
